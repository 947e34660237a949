// staged_copy_engine: copies pageable host memory to a device through a
// ring of page-locked staging buffers. The source is cut into chunks; host
// threads memcpy chunk k+1 into a free staging slot while the DMA of chunk
// k runs, and a slot is refilled only after the event recorded behind its
// last DMA has completed. A DMA straight from pageable memory is staged by
// the driver through one small buffer with one core, which is far slower.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "streamalloc/streams/host_backend.hpp"
#include "streamalloc/streams/host_workers.hpp"
#include "streamalloc/streams/pinned_pool.hpp"
#include "streamalloc/util/bytes.hpp"

namespace streamalloc {

struct staged_copy_config {
  std::size_t slot_bytes = 16_MiB;  // size of one staging buffer (the largest chunk)
  int ring_slots = 4;
};

struct staged_copy_counters {
  std::size_t copies = 0;
  std::size_t chunks = 0;
  std::size_t bytes = 0;
  std::size_t slot_waits = 0;  // chunks that had to wait for their slot's DMA
};

class staged_copy_engine {
 public:
  // Copies to `device`. Staging slots come from `pool` on the first copy
  // and stay with the engine; `workers` does the host memcpys.
  staged_copy_engine(host_backend& backend, pinned_pool& pool, host_workers& workers, int device,
                     staged_copy_config config = {});
  // Waits for the DMAs still reading staging slots, then returns the slots.
  ~staged_copy_engine();
  staged_copy_engine(const staged_copy_engine&) = delete;
  staged_copy_engine& operator=(const staged_copy_engine&) = delete;

  // Copies `bytes` from `src` (any host memory) to `device_dst` on
  // `stream`. Returns as soon as every byte of `src` has been read, so the
  // caller may overwrite it; the device copy itself completes in stream
  // order (work enqueued on `stream` later sees the bytes). Copies through
  // one engine take turns. Throws device_failure when the backend fails
  // and pinned_out_of_memory when the staging slots cannot be pinned.
  void copy_to_device(void* device_dst, const void* src, std::size_t bytes, stream_handle stream);
  // Blocks until no DMA reads a staging slot.
  void synchronize();

  // The chunk a copy of `bytes` is cut into: small enough that a copy
  // spans several chunks (so memcpy and DMA overlap), at least 1 MiB, at
  // most one slot.
  std::size_t chunk_bytes_for(std::size_t bytes) const;

  int device() const { return device_; }
  const staged_copy_config& config() const { return config_; }
  staged_copy_counters counters() const;

  static constexpr std::size_t k_min_chunk_bytes = 1_MiB;

 private:
  struct slot {
    void* buffer = nullptr;
    event_handle event = 0;
    bool in_flight = false;  // a DMA from it may still be running
  };

  void ensure_slots_locked();
  void wait_for_slot_locked(slot& s);

  host_backend& backend_;
  pinned_pool& pool_;
  host_workers& workers_;
  const int device_;
  const staged_copy_config config_;
  mutable std::mutex mutex_;
  std::vector<slot> slots_;
  std::size_t next_slot_ = 0;
  staged_copy_counters counters_;
};

}  // namespace streamalloc
