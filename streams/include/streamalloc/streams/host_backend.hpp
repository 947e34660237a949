// The host-backend interface: everything the pinned pool and the staged
// copy engine ask of the host side of a device: page-locked memory, events
// bound to a device, and host-to-device copies on a stream. Like
// device_backend it returns a status and never throws; streams and events
// cross it as opaque integer handles, so callers never see a CUDA type.
#pragma once

#include <cstddef>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/util/status.hpp"

namespace streamalloc {

// How a range of host memory becomes page-locked.
enum class pin_method {
  // One driver call that allocates and locks (cudaHostAlloc).
  host_alloc,
  // Ordinary aligned memory whose pages several threads touch first, then
  // locked in place (cudaHostRegister): faster for large ranges because the
  // page faults run in parallel instead of inside one driver call.
  register_touched,
};

const char* to_string(pin_method method);

class host_backend {
 public:
  virtual ~host_backend() = default;

  // --- Page-locked host memory ---
  // `bytes` > 0; the result is aligned to at least 4 KiB. Release takes the
  // same bytes and method the range was allocated with.
  virtual status allocate_pinned(std::size_t bytes, pin_method method, void** out) = 0;
  virtual status release_pinned(void* ptr, std::size_t bytes, pin_method method) = 0;

  // --- Events: each belongs to the device it was created for and may only
  // be recorded on streams of that device ---
  virtual status create_event(int device, event_handle* out) = 0;
  virtual status destroy_event(event_handle event) = 0;
  // Captures the work enqueued on `stream` so far.
  virtual status record_event(event_handle event, stream_handle stream) = 0;
  // Sets *done to whether the work captured by the last record has finished
  // (true for an event never recorded).
  virtual status query_event(event_handle event, bool* done) = 0;
  // Blocks the calling thread until the last record has finished.
  virtual status synchronize_event(event_handle event) = 0;

  // --- Copies ---
  // Enqueues a copy of `bytes` from page-locked host memory to device
  // memory on `stream` of `device`; returns before the copy runs.
  virtual status copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes, stream_handle stream,
                                      int device) = 0;
  // Blocks until all work on `device` has finished.
  virtual status synchronize_device(int device) = 0;
};

}  // namespace streamalloc
