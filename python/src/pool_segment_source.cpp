// pool_segment_source: see the header. The user's allocator signals "no
// memory" by returning nullptr or by throwing torch's OutOfMemoryError;
// both continue streamalloc's OOM ladder. Nothing may escape into the core.
#include "pool_segment_source.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <exception>
#include <string>

namespace streamalloc {

status pool_segment_source::allocate_segment(std::size_t bytes, stream_handle stream, void** out) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* ptr = allocator_->raw_alloc_with_stream(bytes, reinterpret_cast<cudaStream_t>(stream));
    if (ptr == nullptr) return {status_code::out_of_memory, "the memory pool's allocator returned no memory"};
    *out = ptr;
    return status::success();
  } catch (const c10::OutOfMemoryError& e) {
    return {status_code::out_of_memory, e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {status_code::device_error, std::string("the memory pool's allocator failed: ") + e.what()};
  }
}

status pool_segment_source::free_segment(void* ptr, std::size_t /*bytes*/, stream_handle /*stream*/) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    allocator_->raw_delete(ptr);
    return status::success();
  } catch (const std::exception& e) {
    return {status_code::device_error, std::string("the memory pool's allocator failed to free: ") + e.what()};
  }
}

}  // namespace streamalloc
