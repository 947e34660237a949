// torch_tags: see the header.
#include "torch_tags.hpp"

#include <cstdint>
#include <exception>
#include <mutex>

namespace streamalloc {

namespace detail {
std::atomic<bool> tagging_flag{false};
}  // namespace detail

allocation_tags& process_allocation_tags() {
  static allocation_tags* const tags = new allocation_tags();
  return *tags;
}

void enable_tagging(const tagging_options& options) {
  process_allocation_tags().enable(options);
  detail::tagging_flag.store(true, std::memory_order_relaxed);
}

void disable_tagging() {
  // The flag first: allocations in flight may still record once, and the
  // next enable() starts from no records anyway.
  detail::tagging_flag.store(false, std::memory_order_relaxed);
  process_allocation_tags().disable();
}

void record_allocation(device_allocator& allocator, int device, const void* ptr, std::size_t requested) noexcept {
  if (ptr == nullptr) return;
  try {
    allocation_tags& tags = process_allocation_tags();
    const std::uint32_t weight = tags.sample(requested);
    if (weight == 0) return;
    // The block's size, not the request: that is what memory_allocated()
    // counts, so the sums of a report match it exactly.
    tags.record(reinterpret_cast<std::uintptr_t>(ptr), allocator.allocation_size(ptr), device, weight);
  } catch (const std::exception&) {
    // Out of host memory for the record: the report undercounts this one.
  }
}

void forget_allocation(const void* ptr) noexcept {
  try {
    process_allocation_tags().erase(reinterpret_cast<std::uintptr_t>(ptr));
  } catch (const std::exception&) {
    // A mutex that cannot be locked leaves a stale record, nothing worse.
  }
}

}  // namespace streamalloc
