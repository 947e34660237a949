// The simulated device for streamalloc-bench --smoke and for profiling the
// allocator's hot path without a GPU (callgrind counts instructions the same
// way on every run): sim_backend with events that complete at once.
#include <memory>
#include <string>

#include "bench_allocator.hpp"
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc::bench {
namespace {

class sim_device final : public bench_device {
 public:
  sim_device() : backend_(sim_config{}) {}

  std::string description() const override {
    return "simulated device (sim_backend, " + format_bytes(backend_.capacity_bytes()) + ", events complete at once)";
  }
  bool simulated() const override { return true; }
  bench_stream create_stream() override { return backend_.new_stream(); }
  void synchronize() override { (void)backend_.synchronize_device(); }
  device_backend& backend() override { return backend_; }

 private:
  sim_backend backend_;
};

}  // namespace

std::unique_ptr<bench_device> make_sim_device() { return std::make_unique<sim_device>(); }

}  // namespace streamalloc::bench
