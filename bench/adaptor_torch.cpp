// streamalloc-bench adaptor for PyTorch's native CUDA caching allocator,
// reached through c10's raw_alloc_with_stream / raw_delete (what
// torch.cuda.caching_allocator_alloc calls), in this process with no Python.
// Built only when STREAMALLOC_TORCH is on.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "bench_allocator.hpp"

namespace streamalloc::bench {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// The column must be torch's default configuration: any allocator setting
// (backend:cudaMallocAsync, expandable_segments, ...) would make it another
// allocator under the same name.
void require_default_torch_config() {
  for (const char* variable : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* value = std::getenv(variable);
    if (value != nullptr && *value != '\0') {
      throw std::runtime_error(std::string(variable) + "='" + value +
                               "' is set; unset it so torch_native measures torch's default allocator");
    }
  }
  const std::string backend = torch_alloc::name();
  if (backend != "native") {
    throw std::runtime_error("torch's CUDA allocator backend is '" + backend + "', not 'native'");
  }
}

class torch_native_adaptor final : public bench_allocator {
 public:
  torch_native_adaptor() {
    require_default_torch_config();
    // Without Python nothing has initialized torch's allocator yet.
    torch_alloc::CUDAAllocator* allocator = torch_alloc::get();
    if (!allocator->initialized()) allocator->init(c10::cuda::device_count());
  }

  const char* name() const override { return "torch_native"; }
  std::string settings() const override { return "c10 CUDACachingAllocator backend '" + torch_alloc::name() + "'"; }

  void* allocate(std::size_t bytes, bench_stream stream) override {
    return torch_alloc::raw_alloc_with_stream(bytes, reinterpret_cast<cudaStream_t>(stream));
  }
  void free(void* ptr, bench_stream /*stream*/) override { torch_alloc::raw_delete(ptr); }

  void end_pattern() override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    const auto stats = torch_alloc::getDeviceStats(device);
    const auto live = stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
    if (live != 0) {
      throw std::runtime_error("torch's allocator still counts " + std::to_string(live) +
                               " allocated bytes after the pattern");
    }
    torch_alloc::emptyCache();
  }
};

}  // namespace

std::unique_ptr<bench_allocator> make_torch_native_adaptor(bench_device& /*device*/) {
  return std::make_unique<torch_native_adaptor>();
}

}  // namespace streamalloc::bench
