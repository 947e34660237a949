// streamalloc-bench adaptor for CUDA's stream-ordered allocator:
// cudaMallocAsync/cudaFreeAsync on the device's default memory pool with
// its release threshold at UINT64_MAX, the setting torch uses for
// backend:cudaMallocAsync, so freed memory stays in the pool.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "bench_allocator.hpp"

namespace streamalloc::bench {
namespace {

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error));
  }
}

class cuda_async_adaptor final : public bench_allocator {
 public:
  explicit cuda_async_adaptor(bench_device& device) : device_(device) {
    const int index = device.backend().device_index();
    check(cudaDeviceGetDefaultMemPool(&pool_, index), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
          "cudaMemPoolSetAttribute(release threshold)");
    check(cudaDeviceSetMemPool(index, pool_), "cudaDeviceSetMemPool");
  }

  const char* name() const override { return "cuda_async"; }
  std::string settings() const override { return "default pool, release threshold UINT64_MAX"; }

  void* allocate(std::size_t bytes, bench_stream stream) override {
    void* ptr = nullptr;
    if (cudaMallocAsync(&ptr, bytes, reinterpret_cast<cudaStream_t>(stream)) != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::bad_alloc();
    }
    return ptr;
  }
  void free(void* ptr, bench_stream stream) override {
    check(cudaFreeAsync(ptr, reinterpret_cast<cudaStream_t>(stream)), "cudaFreeAsync");
  }

  void end_pattern() override {
    device_.synchronize();
    std::uint64_t used = 0;
    check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used), "cudaMemPoolGetAttribute(used)");
    if (used != 0) throw std::runtime_error("the cudaMallocAsync pool still has " + std::to_string(used) + " bytes in use");
    check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }

 private:
  bench_device& device_;
  cudaMemPool_t pool_ = nullptr;
};

}  // namespace

std::unique_ptr<bench_allocator> make_cuda_async_adaptor(bench_device& device) {
  return std::make_unique<cuda_async_adaptor>(device);
}

}  // namespace streamalloc::bench
