// cuda_device_guard: makes a device current for one scope and restores the
// previous one, so a backend never changes which device the rest of the
// thread works on. CUDA targets only (it includes the runtime header).
#pragma once

#include <cuda_runtime_api.h>

namespace streamalloc {

class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) {
    int current = -1;
    error_ = cudaGetDevice(&current);
    if (error_ != cudaSuccess || current == device) return;
    error_ = cudaSetDevice(device);
    if (error_ == cudaSuccess) previous_ = current;
  }
  ~cuda_device_guard() {
    if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;

  bool ok() const { return error_ == cudaSuccess; }
  cudaError_t error() const { return error_; }

 private:
  cudaError_t error_ = cudaSuccess;
  int previous_ = -1;
};

}  // namespace streamalloc
