// cuda_host_backend: pinned memory, events and host-to-device copies
// through the CUDA runtime. Every failure becomes a status with the CUDA
// error name; nothing here throws. Each call that needs a device makes it
// current for the call only, so the caller's current device never changes.
#include "streamalloc/streams/cuda_host_backend.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "cuda_device_guard.hpp"
#include "cuda_status.hpp"
#include "streamalloc/streams/host_memory.hpp"

namespace streamalloc {
namespace {

struct cuda_event {
  cudaEvent_t event = nullptr;
  int device = 0;
};

cuda_event* as_event(event_handle handle) { return reinterpret_cast<cuda_event*>(handle); }

}  // namespace

cuda_host_backend::cuda_host_backend(int touch_threads) : touch_threads_(touch_threads) {}

status cuda_host_backend::allocate_pinned(std::size_t bytes, pin_method method, void** out) {
  if (bytes == 0) return {status_code::invalid_argument, "allocate_pinned of zero bytes"};
  // Portable: the memory counts as pinned for every device's context.
  if (method == pin_method::host_alloc) {
    const cudaError_t error = cudaHostAlloc(out, bytes, cudaHostAllocPortable);
    if (error != cudaSuccess) return cuda_failure(error, "cudaHostAlloc of " + std::to_string(bytes) + " bytes");
    return status::success();
  }
  void* ptr = nullptr;
  if (status st = map_host_pages(bytes, touch_threads_, &ptr); !st) return st;
  const cudaError_t error = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (error != cudaSuccess) {
    const status st = cuda_failure(error, "cudaHostRegister of " + std::to_string(bytes) + " bytes");
    unmap_host_pages(ptr, bytes);
    return st;
  }
  *out = ptr;
  return status::success();
}

status cuda_host_backend::release_pinned(void* ptr, std::size_t bytes, pin_method method) {
  if (method == pin_method::host_alloc) {
    const cudaError_t error = cudaFreeHost(ptr);
    if (error != cudaSuccess) return cuda_failure(error, "cudaFreeHost");
    return status::success();
  }
  const cudaError_t error = cudaHostUnregister(ptr);
  if (error != cudaSuccess) return cuda_failure(error, "cudaHostUnregister");
  return unmap_host_pages(ptr, bytes);
}

status cuda_host_backend::create_event(int device, event_handle* out) {
  cuda_device_guard guard(device);
  if (guard.error() != cudaSuccess) return cuda_failure(guard.error(), "selecting CUDA device " + std::to_string(device));
  cudaEvent_t event = nullptr;
  const cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (error != cudaSuccess) return cuda_failure(error, "cudaEventCreate on device " + std::to_string(device));
  *out = reinterpret_cast<event_handle>(new cuda_event{event, device});
  return status::success();
}

status cuda_host_backend::destroy_event(event_handle handle) {
  cuda_event* e = as_event(handle);
  cuda_device_guard guard(e->device);
  const cudaError_t error = cudaEventDestroy(e->event);
  delete e;
  if (error != cudaSuccess) return cuda_failure(error, "cudaEventDestroy");
  return status::success();
}

status cuda_host_backend::record_event(event_handle handle, stream_handle stream) {
  cuda_event* e = as_event(handle);
  cuda_device_guard guard(e->device);
  if (guard.error() != cudaSuccess) return cuda_failure(guard.error(), "selecting CUDA device " + std::to_string(e->device));
  const cudaError_t error = cudaEventRecord(e->event, reinterpret_cast<cudaStream_t>(stream));
  if (error != cudaSuccess) return cuda_failure(error, "cudaEventRecord on device " + std::to_string(e->device));
  return status::success();
}

status cuda_host_backend::query_event(event_handle handle, bool* done) {
  const cudaError_t error = cudaEventQuery(as_event(handle)->event);
  if (error == cudaSuccess || error == cudaErrorNotReady) {
    if (error == cudaErrorNotReady) (void)cudaGetLastError();
    *done = error == cudaSuccess;
    return status::success();
  }
  return cuda_failure(error, "cudaEventQuery");
}

status cuda_host_backend::synchronize_event(event_handle handle) {
  const cudaError_t error = cudaEventSynchronize(as_event(handle)->event);
  if (error != cudaSuccess) return cuda_failure(error, "cudaEventSynchronize");
  return status::success();
}

status cuda_host_backend::copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes,
                                               stream_handle stream, int device) {
  cuda_device_guard guard(device);
  if (guard.error() != cudaSuccess) return cuda_failure(guard.error(), "selecting CUDA device " + std::to_string(device));
  const cudaError_t error =
      cudaMemcpyAsync(device_dst, pinned_src, bytes, cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream));
  if (error != cudaSuccess) return cuda_failure(error, "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes to device");
  return status::success();
}

status cuda_host_backend::synchronize_device(int device) {
  cuda_device_guard guard(device);
  if (guard.error() != cudaSuccess) return cuda_failure(guard.error(), "selecting CUDA device " + std::to_string(device));
  const cudaError_t error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return cuda_failure(error, "cudaDeviceSynchronize on device " + std::to_string(device));
  return status::success();
}

}  // namespace streamalloc
