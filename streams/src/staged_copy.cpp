// staged_copy_engine: the chunk loop of a staged pageable-to-device copy.
// For each chunk: take the next ring slot, wait (only if needed) for the
// event behind the slot's previous DMA, memcpy the chunk into it with the
// host workers, enqueue its DMA and record the slot's event behind it. The
// DMA of chunk k then runs while the workers fill chunk k+1.
#include "streamalloc/streams/staged_copy.hpp"

#include <algorithm>
#include <string>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

constexpr std::size_t k_chunk_alignment_bytes = 64_KiB;

}  // namespace

staged_copy_engine::staged_copy_engine(host_backend& backend, pinned_pool& pool, host_workers& workers, int device,
                                       staged_copy_config config)
    : backend_(backend), pool_(pool), workers_(workers), device_(device), config_(config) {
  if (config_.ring_slots < 2) {
    throw usage_error("staged_copy_config.ring_slots must be at least 2 (one slot fills while another copies), got " +
                      std::to_string(config_.ring_slots));
  }
  if (config_.slot_bytes == 0) throw usage_error("staged_copy_config.slot_bytes must not be 0");
}

staged_copy_engine::~staged_copy_engine() {
  // Failures are ignored: a device that cannot synchronize runs nothing.
  for (slot& s : slots_) {
    if (s.in_flight) backend_.synchronize_event(s.event);
    backend_.destroy_event(s.event);
    pool_.free(s.buffer);
  }
}

std::size_t staged_copy_engine::chunk_bytes_for(std::size_t bytes) const {
  const std::size_t slots = static_cast<std::size_t>(config_.ring_slots);
  std::size_t chunk = (bytes + slots - 1) / slots;
  chunk = (chunk + k_chunk_alignment_bytes - 1) / k_chunk_alignment_bytes * k_chunk_alignment_bytes;
  chunk = std::max(chunk, k_min_chunk_bytes);
  return std::min(chunk, config_.slot_bytes);
}

void staged_copy_engine::ensure_slots_locked() {
  if (!slots_.empty()) return;
  std::vector<slot> made;
  made.reserve(static_cast<std::size_t>(config_.ring_slots));
  auto undo = [&] {
    for (slot& s : made) {
      if (s.event != 0) backend_.destroy_event(s.event);
      pool_.free(s.buffer);
    }
  };
  try {
    for (int i = 0; i < config_.ring_slots; ++i) {
      slot s;
      s.buffer = pool_.allocate(config_.slot_bytes);
      made.push_back(s);
      const status st = backend_.create_event(device_, &made.back().event);
      if (!st) {
        throw device_failure("staged copy: creating an event on device " + std::to_string(device_) +
                             " failed: " + st.message());
      }
    }
  } catch (...) {
    undo();
    throw;
  }
  slots_ = std::move(made);
}

void staged_copy_engine::wait_for_slot_locked(slot& s) {
  if (!s.in_flight) return;
  bool done = false;
  if (backend_.query_event(s.event, &done) && done) {
    s.in_flight = false;
    return;
  }
  ++counters_.slot_waits;
  const status st = backend_.synchronize_event(s.event);
  if (!st) throw device_failure("staged copy: waiting for a staging buffer failed: " + st.message());
  s.in_flight = false;
}

void staged_copy_engine::copy_to_device(void* device_dst, const void* src, std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_slots_locked();
  const std::size_t chunk = chunk_bytes_for(bytes);
  auto* out = static_cast<unsigned char*>(device_dst);
  const auto* in = static_cast<const unsigned char*>(src);
  ++counters_.copies;
  for (std::size_t offset = 0; offset < bytes; offset += chunk) {
    const std::size_t length = std::min(chunk, bytes - offset);
    slot& s = slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % slots_.size();
    wait_for_slot_locked(s);
    workers_.copy(s.buffer, in + offset, length);
    status st = backend_.copy_to_device_async(out + offset, s.buffer, length, stream, device_);
    if (!st) {
      throw device_failure("staged copy: enqueueing a copy to device " + std::to_string(device_) +
                           " failed: " + st.message());
    }
    st = backend_.record_event(s.event, stream);
    if (!st) {
      // Nothing would tell when the DMA just enqueued stops reading the
      // slot; waiting for the device does. If even that fails, the context
      // is broken and runs no more copies.
      backend_.synchronize_device(device_);
      throw device_failure("staged copy: recording an event failed: " + st.message());
    }
    s.in_flight = true;
    ++counters_.chunks;
    counters_.bytes += length;
  }
}

void staged_copy_engine::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (slot& s : slots_) {
    if (!s.in_flight) continue;
    const status st = backend_.synchronize_event(s.event);
    if (!st) throw device_failure("staged copy: waiting for a staging buffer failed: " + st.message());
    s.in_flight = false;
  }
}

staged_copy_counters staged_copy_engine::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace streamalloc
