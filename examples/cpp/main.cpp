// Allocates and frees device memory through streamalloc's caching allocator
// and prints what it cached: on the simulated device (no GPU needed), or
// with --cuda on GPU 0 when streamalloc was built with CUDA.
#include <cstdio>
#include <cstring>
#include <memory>

#include <streamalloc/backend/sim_backend.hpp>
#include <streamalloc/core/caching_allocator.hpp>
#include <streamalloc/core/config.hpp>
#include <streamalloc/version.hpp>
#ifdef EXAMPLE_HAVE_CUDA
#include <streamalloc/backend/cuda_backend.hpp>
#endif

int main(int argc, char** argv) {
  using namespace streamalloc;
  const bool cuda = argc > 1 && std::strcmp(argv[1], "--cuda") == 0;

  std::unique_ptr<device_backend> backend;
  if (cuda) {
#ifdef EXAMPLE_HAVE_CUDA
    status error;
    backend = make_cuda_backend(0, &error);
    if (!backend) {
      std::fprintf(stderr, "streamalloc_example: no CUDA device: %s\n", error.message().c_str());
      return 1;
    }
#else
    std::fprintf(stderr, "streamalloc_example: this streamalloc was installed without CUDA\n");
    return 1;
#endif
  } else {
    sim_config device;
    device.capacity_bytes = 8_GiB;
    backend = std::make_unique<sim_backend>(device);
  }

  // The same syntax and keys as STREAMALLOC_CONF.
  caching_allocator allocator(*backend, allocator_config::parse("max_split_size_mb:256"));
  const stream_handle stream = 0;  // the default stream

  void* activations = allocator.allocate(64_MiB, stream);
  void* small = allocator.allocate(4_KiB, stream);
  allocator.free(activations);
  void* again = allocator.allocate(48_MiB, stream);  // served from the cached 64 MiB block
  allocator.free(again);
  allocator.free(small);
  allocator.validate();

  const device_stats stats = allocator.stats();
  const auto all = static_cast<int>(stat_type::all);
  std::printf("streamalloc %s on the %s device\n", STREAMALLOC_VERSION, cuda ? "CUDA" : "simulated");
  std::printf("reserved %lld bytes in %lld segments, %lld device allocations, %lld allocated now\n",
              static_cast<long long>(stats.reserved_bytes[all].current),
              static_cast<long long>(stats.segment[all].current), static_cast<long long>(stats.num_device_alloc),
              static_cast<long long>(stats.allocated_bytes[all].current));
  allocator.empty_cache();
  return allocator.stats().reserved_bytes[all].current == 0 ? 0 : 1;
}
