// cuda_backend: the CUDA-runtime device_backend. Every runtime failure is
// turned into a status carrying the CUDA error name and text; nothing here
// throws or aborts. The slow paths (segment growth, release, device-wide
// synchronize) are NVTX ranges in domain "streamalloc" for Nsight traces.
#include "streamalloc/backend/cuda_backend.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "cuda_device_guard.hpp"
#include "cuda_status.hpp"
#include "nvml_processes.hpp"
#include "nvtx_ranges.hpp"
#include "streamalloc/backend/vmm_backend.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

std::string describe(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

status failure(cudaError_t error, int device, const std::string& what) {
  return cuda_failure(error, what + " on CUDA device " + std::to_string(device));
}

// Switches this thread to relaxed stream-capture mode for its lifetime: a
// segment may have to grow while a CUDA graph is being captured, and
// cudaMalloc / cudaMemGetInfo are refused in the default (global) mode.
class relaxed_capture_mode {
 public:
  relaxed_capture_mode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~relaxed_capture_mode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

using detail::names;
using detail::trace_range;

cudaStream_t to_stream(stream_handle stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t to_event(event_handle event) { return reinterpret_cast<cudaEvent_t>(event); }

}  // namespace

status cuda_backend::allocate_segment(std::size_t bytes, void** out) {
  if (out == nullptr || bytes == 0) return {status_code::invalid_argument, "allocate_segment needs bytes > 0 and an output"};
  trace_range range(names().grow, bytes);
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  void* ptr = nullptr;
  relaxed_capture_mode relaxed;
  const cudaError_t error = cudaMalloc(&ptr, bytes);
  if (error != cudaSuccess) return failure(error, device_, "cudaMalloc(" + format_bytes(bytes) + ")");
  *out = ptr;
  return status::success();
}

status cuda_backend::free_segment(void* ptr, std::size_t bytes) {
  if (ptr == nullptr) return {status_code::invalid_argument, "free_segment of a null pointer"};
  trace_range range(names().release, bytes);
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  const cudaError_t error = cudaFree(ptr);
  if (error != cudaSuccess) return failure(error, device_, "cudaFree(" + format_bytes(bytes) + ")");
  return status::success();
}

status cuda_backend::memory_info(device_memory_info* out) {
  if (out == nullptr) return {status_code::invalid_argument, "memory_info needs an output"};
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  relaxed_capture_mode relaxed;
  const cudaError_t error = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (error != cudaSuccess) return failure(error, device_, "cudaMemGetInfo");
  out->free_bytes = free_bytes;
  out->total_bytes = total_bytes;
  return status::success();
}

status cuda_backend::device_processes(std::vector<device_process>* out) {
  if (out == nullptr) return {status_code::invalid_argument, "device_processes needs an output"};
  char pci_bus_id[32] = {};
  const cudaError_t error = cudaDeviceGetPCIBusId(pci_bus_id, static_cast<int>(sizeof(pci_bus_id)), device_);
  if (error != cudaSuccess) return failure(error, device_, "cudaDeviceGetPCIBusId");
  return nvml_device_processes(pci_bus_id, out);
}

status cuda_backend::create_event(event_handle* out) {
  if (out == nullptr) return {status_code::invalid_argument, "create_event needs an output"};
  // Events belong to the device current at creation.
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  cudaEvent_t event = nullptr;
  const cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (error != cudaSuccess) return failure(error, device_, "cudaEventCreateWithFlags");
  *out = reinterpret_cast<event_handle>(event);
  return status::success();
}

status cuda_backend::destroy_event(event_handle event) {
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  const cudaError_t error = cudaEventDestroy(to_event(event));
  if (error != cudaSuccess) return failure(error, device_, "cudaEventDestroy");
  return status::success();
}

status cuda_backend::record_event(event_handle event, stream_handle stream) {
  // Stream 0 means the default stream of the *current* device.
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  const cudaError_t error = cudaEventRecord(to_event(event), to_stream(stream));
  if (error != cudaSuccess) return failure(error, device_, "cudaEventRecord");
  return status::success();
}

status cuda_backend::query_event(event_handle event, bool* done) {
  if (done == nullptr) return {status_code::invalid_argument, "query_event needs an output"};
  const cudaError_t error = cudaEventQuery(to_event(event));
  if (error == cudaSuccess) {
    *done = true;
    return status::success();
  }
  if (error == cudaErrorNotReady) {
    // Not a failure, but clear it so later cudaGetLastError() checks pass.
    (void)cudaGetLastError();
    *done = false;
    return status::success();
  }
  return failure(error, device_, "cudaEventQuery");
}

status cuda_backend::synchronize_event(event_handle event) {
  const cudaError_t error = cudaEventSynchronize(to_event(event));
  if (error != cudaSuccess) return failure(error, device_, "cudaEventSynchronize");
  return status::success();
}

status cuda_backend::stream_wait_event(stream_handle stream, event_handle event) {
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  const cudaError_t error = cudaStreamWaitEvent(to_stream(stream), to_event(event), 0);
  if (error != cudaSuccess) return failure(error, device_, "cudaStreamWaitEvent");
  return status::success();
}

status cuda_backend::capture_frontier(stream_handle stream, bool* capturing, std::vector<graph_node_handle>* frontier) {
  if (capturing == nullptr || frontier == nullptr) return {status_code::invalid_argument, "capture_frontier needs outputs"};
  cudaStreamCaptureStatus capture_status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* nodes = nullptr;
  std::size_t count = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t error =
      cudaStreamGetCaptureInfo(to_stream(stream), &capture_status, nullptr, nullptr, &nodes, nullptr, &count);
#else
  const cudaError_t error = cudaStreamGetCaptureInfo(to_stream(stream), &capture_status, nullptr, nullptr, &nodes, &count);
#endif
  if (error != cudaSuccess) return failure(error, device_, "cudaStreamGetCaptureInfo");
  *capturing = capture_status == cudaStreamCaptureStatusActive;
  frontier->clear();
  if (*capturing) {
    for (std::size_t i = 0; i < count; ++i) frontier->push_back(reinterpret_cast<graph_node_handle>(nodes[i]));
  }
  return status::success();
}

status cuda_backend::capture_dependencies(graph_node_handle node, std::vector<graph_node_handle>* out) {
  if (out == nullptr) return {status_code::invalid_argument, "capture_dependencies needs an output"};
  const auto graph_node = reinterpret_cast<cudaGraphNode_t>(node);
  std::size_t count = 0;
#if CUDART_VERSION >= 13000
  cudaError_t error = cudaGraphNodeGetDependencies(graph_node, nullptr, nullptr, &count);
#else
  cudaError_t error = cudaGraphNodeGetDependencies(graph_node, nullptr, &count);
#endif
  if (error != cudaSuccess) return failure(error, device_, "cudaGraphNodeGetDependencies");
  std::vector<cudaGraphNode_t> nodes(count);
  if (count != 0) {
#if CUDART_VERSION >= 13000
    error = cudaGraphNodeGetDependencies(graph_node, nodes.data(), nullptr, &count);
#else
    error = cudaGraphNodeGetDependencies(graph_node, nodes.data(), &count);
#endif
    if (error != cudaSuccess) return failure(error, device_, "cudaGraphNodeGetDependencies");
  }
  out->clear();
  for (std::size_t i = 0; i < count; ++i) out->push_back(reinterpret_cast<graph_node_handle>(nodes[i]));
  return status::success();
}

status cuda_backend::synchronize_device() {
  trace_range range(names().synchronize, 0);
  cuda_device_guard guard(device_);
  if (!guard.ok()) return failure(guard.error(), device_, "cudaSetDevice");
  const cudaError_t error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return failure(error, device_, "cudaDeviceSynchronize");
  return status::success();
}

int cuda_device_count(status* error) {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    (void)cudaGetLastError();
    // Whatever the reason (no GPU, no driver, a stub driver), no device can be used.
    if (error != nullptr) *error = {status_code::no_device, "no usable CUDA device: cudaGetDeviceCount failed: " + describe(result)};
    return 0;
  }
  if (count <= 0) {
    if (error != nullptr) *error = {status_code::no_device, "no usable CUDA device: cudaGetDeviceCount found 0 devices"};
    return 0;
  }
  return count;
}

std::unique_ptr<device_backend> make_cuda_backend(int device, status* error) {
  status count_error;
  const int count = cuda_device_count(&count_error);
  if (count == 0) {
    if (error != nullptr) *error = count_error;
    return nullptr;
  }
  if (device < 0 || device >= count) {
    if (error != nullptr) {
      *error = {status_code::no_device, "CUDA device " + std::to_string(device) + " does not exist (" +
                                            std::to_string(count) + " visible)"};
    }
    return nullptr;
  }
  // Making the device current once creates its context, so a device that
  // cannot be used is reported here rather than at the first allocation.
  cuda_device_guard guard(device);
  if (!guard.ok()) {
    const status failed = failure(guard.error(), device, "cudaSetDevice");
    if (error != nullptr) *error = failed;
    return nullptr;
  }
  // The allocator's config decides whether the virtual-memory operations
  // are used; offering them costs nothing when they are not.
  if (std::unique_ptr<device_backend> vmm = vmm_backend::create(device)) return vmm;
  return std::unique_ptr<device_backend>(new cuda_backend(device));
}

}  // namespace streamalloc
