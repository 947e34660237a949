// Where a private pool's segments come from when not from the device
// backend: torch.cuda.MemPool(allocator=...) hands its pool's segments to
// the user's allocator. Called with the allocator's lock held (as torch's
// own allocator calls a pool's allocator), so it must not call back into
// the same caching_allocator.
#pragma once

#include <cstddef>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/util/status.hpp"

namespace streamalloc {

class segment_source {
 public:
  virtual ~segment_source() = default;
  // status_code::out_of_memory when the source has no room; the OOM ladder
  // then continues as for the device backend.
  virtual status allocate_segment(std::size_t bytes, stream_handle stream, void** out) = 0;
  virtual status free_segment(void* ptr, std::size_t bytes, stream_handle stream) = 0;
};

}  // namespace streamalloc
