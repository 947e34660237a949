// cuda_host_backend: the host_backend of the CUDA runtime: cudaHostAlloc
// or touched pages + cudaHostRegister, timing-free events created on their
// device, cudaMemcpyAsync. The header names no CUDA type; the target that
// builds it (streamalloc_streams_cuda) is the only streams target that
// sees the toolkit.
#pragma once

#include "streamalloc/streams/host_backend.hpp"

namespace streamalloc {

class cuda_host_backend final : public host_backend {
 public:
  // `touch_threads`: how many threads pre-fault the pages of a
  // register_touched allocation.
  explicit cuda_host_backend(int touch_threads);
  ~cuda_host_backend() override = default;

  status allocate_pinned(std::size_t bytes, pin_method method, void** out) override;
  status release_pinned(void* ptr, std::size_t bytes, pin_method method) override;
  status create_event(int device, event_handle* out) override;
  status destroy_event(event_handle event) override;
  status record_event(event_handle event, stream_handle stream) override;
  status query_event(event_handle event, bool* done) override;
  status synchronize_event(event_handle event) override;
  status copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes, stream_handle stream,
                              int device) override;
  status synchronize_device(int device) override;

 private:
  int touch_threads_;
};

}  // namespace streamalloc
