// Introspection of the process allocators: see the header.
#include "introspection.hpp"

#include <iterator>
#include <limits>
#include <string>

#include "process_allocator.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

// Rejects negative indices always, and indices past the managed devices once
// streamalloc knows how many there are.
void check_device_index(int device) {
  const int count = managed_device_count();
  if (device < 0 || (count > 0 && device >= count)) {
    throw usage_error("streamalloc: device index " + std::to_string(device) + " does not exist (" +
                      std::to_string(count) + " device(s) managed)");
  }
}

}  // namespace

device_allocator* existing_allocator_of(int device) {
  device_allocators* all = find_process_allocators();
  return all == nullptr ? nullptr : all->find(device);
}

device_allocator& allocator_of(int device) {
  if (device_allocator* existing = existing_allocator_of(device)) return *existing;
  return process_allocators().at(device);
}

int managed_device_count() {
  device_allocators* all = find_process_allocators();
  return all == nullptr ? 0 : all->device_count();
}

device_stats device_stats_of(int device) {
  check_device_index(device);
  if (device_allocator* allocator = existing_allocator_of(device)) return allocator->stats();
  device_stats unused;
  const allocator_config config = process_allocator_config();
  unused.max_split_size = config.max_split_bytes == std::numeric_limits<std::size_t>::max()
                              ? -1
                              : static_cast<std::int64_t>(config.max_split_bytes);
  return unused;
}

void reset_peak_stats_of(int device) {
  check_device_index(device);
  if (device_allocator* allocator = existing_allocator_of(device)) allocator->reset_peak_stats();
}

void reset_accumulated_stats_of(int device) {
  check_device_index(device);
  if (device_allocator* allocator = existing_allocator_of(device)) allocator->reset_accumulated_stats();
}

void empty_caches() {
  for (int d = 0; d < managed_device_count(); ++d) {
    if (device_allocator* allocator = existing_allocator_of(d)) allocator->empty_cache();
  }
}

std::vector<segment_info> collect_segments(int device) {
  if (device != k_all_devices) check_device_index(device);
  std::vector<segment_info> out;
  const int count = managed_device_count();
  for (int d = 0; d < count; ++d) {
    if (device != k_all_devices && d != device) continue;
    device_allocator* allocator = existing_allocator_of(d);
    if (allocator == nullptr) continue;
    allocator_snapshot snapshot = allocator->snapshot();
    std::move(snapshot.segments.begin(), snapshot.segments.end(), std::back_inserter(out));
  }
  return out;
}

}  // namespace streamalloc
