// A user allocator for torch.cuda.MemPool(allocator=...) tests: plain
// cudaMalloc/cudaFree behind torch's CUDAPluggableAllocator symbols, with
// counters the tests read through ctypes to prove which allocator served a
// pool's segments.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <sys/types.h>

namespace {
std::atomic<long> g_allocations{0};
std::atomic<long> g_frees{0};
std::atomic<long> g_live_bytes{0};
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* counting_alloc(ssize_t size, int device, cudaStream_t /*stream*/) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, static_cast<std::size_t>(size));
  cudaSetDevice(previous);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  ++g_allocations;
  g_live_bytes += size;
  return ptr;
}

__attribute__((visibility("default"))) void counting_free(void* ptr, ssize_t size, int /*device*/,
                                                          cudaStream_t /*stream*/) {
  cudaFree(ptr);
  ++g_frees;
  g_live_bytes -= size;
}

__attribute__((visibility("default"))) long counting_allocations() { return g_allocations.load(); }
__attribute__((visibility("default"))) long counting_frees() { return g_frees.load(); }
__attribute__((visibility("default"))) long counting_live_bytes() { return g_live_bytes.load(); }
}
