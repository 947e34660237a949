// cuda_backend: device_backend for one GPU through the CUDA runtime
// (cudaMalloc/cudaFree segments, timing-free events, stream waits). No CUDA
// type appears here: cudaStream_t/cudaEvent_t travel as the opaque handles.
#pragma once

#include <memory>

#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {

class cuda_backend : public device_backend {
 public:
  ~cuda_backend() override = default;

  int device_index() const override { return device_; }
  status allocate_segment(std::size_t bytes, void** out) override;
  status free_segment(void* ptr, std::size_t bytes) override;
  status memory_info(device_memory_info* out) override;
  status device_processes(std::vector<device_process>* out) override;  // through NVML
  status create_event(event_handle* out) override;
  status destroy_event(event_handle event) override;
  status record_event(event_handle event, stream_handle stream) override;
  status query_event(event_handle event, bool* done) override;
  status synchronize_event(event_handle event) override;
  status stream_wait_event(stream_handle stream, event_handle event) override;
  status synchronize_device() override;
  status capture_frontier(stream_handle stream, bool* capturing, std::vector<graph_node_handle>* frontier) override;
  status capture_dependencies(graph_node_handle node, std::vector<graph_node_handle>* out) override;

 protected:
  // Only make_cuda_backend constructs one (directly or as a vmm_backend):
  // it checks the index first.
  explicit cuda_backend(int device) : device_(device) {}
  friend std::unique_ptr<device_backend> make_cuda_backend(int device, status* error);

 private:
  int device_;
};

// The backend for CUDA device `device`, or nullptr with *error set
// (status_code::no_device when there is no GPU, no usable driver, or no
// such index). Matches device_allocators::backend_factory. `error` may be
// null; it is written only on failure. When the driver offers the virtual
// memory API on that device (every entry point vmm_backend needs resolves,
// CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is set and the
// granularity query answers) the result is a vmm_backend, whose
// supports_virtual_memory() is true; otherwise a plain cuda_backend.
std::unique_ptr<device_backend> make_cuda_backend(int device, status* error);

// Number of visible CUDA devices; 0 with *error set (no_device) when the
// runtime finds none or cannot talk to a driver. `error` may be null.
int cuda_device_count(status* error);

}  // namespace streamalloc
