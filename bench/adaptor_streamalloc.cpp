// streamalloc-bench adaptor for streamalloc itself: the caching_allocator's
// direct C++ API over the bench device's backend (cuda_backend on a GPU,
// sim_backend for --smoke), with nothing between the caller and the calls.
#include <memory>
#include <stdexcept>
#include <string>

#include "bench_allocator.hpp"
#include "streamalloc/core/caching_allocator.hpp"

namespace streamalloc::bench {
namespace {

class streamalloc_adaptor final : public bench_allocator {
 public:
  streamalloc_adaptor(bench_device& device, const allocator_config& config) : allocator_(device.backend(), config) {}

  const char* name() const override { return "streamalloc"; }
  std::string settings() const override { return allocator_.config().to_string(); }

  void* allocate(std::size_t bytes, bench_stream stream) override { return allocator_.allocate(bytes, stream); }
  void free(void* ptr, bench_stream /*stream*/) override { allocator_.free(ptr); }

  void end_pattern() override {
    allocator_.validate();
    const device_stats stats = allocator_.stats();
    const auto live = stats.allocated_bytes[static_cast<int>(stat_type::all)].current;
    if (live != 0) {
      throw std::runtime_error("streamalloc still counts " + std::to_string(live) + " allocated bytes after the pattern");
    }
    allocator_.empty_cache();
    const auto reserved = allocator_.stats().reserved_bytes[static_cast<int>(stat_type::all)].current;
    if (reserved != 0) {
      throw std::runtime_error("streamalloc still reserves " + std::to_string(reserved) + " bytes after empty_cache");
    }
  }

 private:
  caching_allocator allocator_;
};

}  // namespace

std::unique_ptr<bench_allocator> make_streamalloc_adaptor(bench_device& device, const allocator_config& config) {
  return std::make_unique<streamalloc_adaptor>(device, config);
}

}  // namespace streamalloc::bench
