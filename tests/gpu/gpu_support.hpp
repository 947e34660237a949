// Helpers shared by the [gpu] tests: whether a GPU is visible (with the
// CUDA error to print when not), RAII streams and buffers, a way to queue
// real device work without a kernel, and a REQUIRE for CUDA runtime calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "support/catch.hpp"

namespace streamalloc::testing {

// Whether cudaGetDeviceCount finds a device; otherwise *reason says why.
inline bool gpu_visible(std::string* reason) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    *reason = std::string("no GPU (cudaGetDeviceCount: ") + cudaGetErrorName(error) + ": " +
              cudaGetErrorString(error) + ")";
    return false;
  }
  if (count == 0) {
    *reason = "no GPU (cudaGetDeviceCount: 0 devices)";
    return false;
  }
  return true;
}

inline bool contains(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

inline int visible_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

// A non-blocking stream (no implicit ordering with the legacy default
// stream), destroyed at scope exit.
class test_stream {
 public:
  test_stream() {
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) stream_ = nullptr;
  }
  ~test_stream() {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  cudaStream_t get() const { return stream_; }
  std::uintptr_t handle() const { return reinterpret_cast<std::uintptr_t>(stream_); }

 private:
  cudaStream_t stream_ = nullptr;
};

// Plain cudaMalloc memory owned by the test (not by the allocator).
class test_buffer {
 public:
  explicit test_buffer(std::size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~test_buffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  test_buffer(const test_buffer&) = delete;
  test_buffer& operator=(const test_buffer&) = delete;
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
};

// Queues `rounds` full memsets of `buffer` on `stream`: with a 1 GiB buffer
// and 64 rounds that is tens of milliseconds of real device work, long
// enough that an event recorded right after is certainly still pending.
inline cudaError_t queue_work(cudaStream_t stream, const test_buffer& buffer, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    const cudaError_t error = cudaMemsetAsync(buffer.get(), i & 0xff, buffer.bytes(), stream);
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

}  // namespace streamalloc::testing

// Ends the test with a visible reason when no GPU is present.
#define STREAMALLOC_REQUIRE_GPU()                                     \
  do {                                                                \
    std::string skip_reason_;                                         \
    if (!streamalloc::testing::gpu_visible(&skip_reason_)) {          \
      WARN("skipped: " << skip_reason_);                              \
      return;                                                         \
    }                                                                 \
  } while (false)

// The [nogpu] tests prove the failure path, so they run only without a GPU.
#define STREAMALLOC_REQUIRE_NO_GPU()                                                     \
  do {                                                                                   \
    std::string skip_reason_;                                                            \
    if (streamalloc::testing::gpu_visible(&skip_reason_)) {                              \
      WARN("skipped: a GPU is visible, so the no-GPU path cannot be exercised here");    \
      return;                                                                            \
    }                                                                                    \
  } while (false)

#define STREAMALLOC_CUDA_REQUIRE(call)                                     \
  do {                                                                     \
    const cudaError_t cuda_result_ = (call);                               \
    INFO(#call << " -> " << cudaGetErrorName(cuda_result_));               \
    REQUIRE(cuda_result_ == cudaSuccess);                                  \
  } while (false)
