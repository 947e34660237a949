// streamalloc-bench adaptor for plain cudaMalloc/cudaFree: the cost every
// caching allocator exists to avoid (~90 us a pair, and cudaFree
// synchronizes the device), so patterns run it with fewer iterations.
#include <cuda_runtime_api.h>

#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "bench_allocator.hpp"

namespace streamalloc::bench {
namespace {

class cuda_malloc_adaptor final : public bench_allocator {
 public:
  const char* name() const override { return "cuda_malloc"; }
  bool slow() const override { return true; }

  void* allocate(std::size_t bytes, bench_stream /*stream*/) override {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::bad_alloc();
    }
    return ptr;
  }
  void free(void* ptr, bench_stream /*stream*/) override {
    const cudaError_t error = cudaFree(ptr);
    if (error != cudaSuccess) {
      throw std::runtime_error(std::string("cudaFree failed: ") + cudaGetErrorName(error) + ": " +
                               cudaGetErrorString(error));
    }
  }

  // cudaMalloc caches nothing and keeps no count to check.
  void end_pattern() override {}
};

}  // namespace

std::unique_ptr<bench_allocator> make_cuda_malloc_adaptor(bench_device& /*device*/) {
  return std::make_unique<cuda_malloc_adaptor>();
}

}  // namespace streamalloc::bench
