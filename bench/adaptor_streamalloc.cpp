// streamalloc-bench adaptor for streamalloc itself: the device_allocator's
// direct C++ API over the bench device's backend (cuda_backend on a GPU,
// sim_backend for --smoke), with nothing between the caller and the calls.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "bench_allocator.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/util/errors.hpp"

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
    device_work_ = describe_work(stats);
    // A pattern that failed before its timed repetitions counts nothing.
    timed_ = false;
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

  bool premake_arenas(int count) override {
    if (count <= 1) return false;
    allocator_.move_this_thread(count - 1);
    allocator_.move_this_thread(0);
    return true;
  }

  void timing_starts() override {
    since_ = allocator_.stats();
    arenas_at_start_ = allocator_.arena_count();
    timed_ = true;
  }

  std::string device_work() const override { return device_work_; }

 private:
  // The device work counted in `now` since timing started and the arenas
  // the timing began with, or "" when none and one.
  std::string describe_work(const device_stats& now) const {
    if (!timed_) return {};
    const struct {
      const char* what;
      std::int64_t count;
    } counts[] = {
        {"device allocations", now.num_device_alloc - since_.num_device_alloc},
        {"device frees", now.num_device_free - since_.num_device_free},
        {"chunk maps", now.num_chunk_maps - since_.num_chunk_maps},
        {"chunk unmaps", now.num_chunk_unmaps - since_.num_chunk_unmaps},
        {"stitch synchronizations", now.num_stitch_syncs - since_.num_stitch_syncs},
        {"full synchronizations", now.num_sync_all_streams - since_.num_sync_all_streams},
        {"cross-stream hand-offs", now.num_cross_stream_reuses - since_.num_cross_stream_reuses},
        {"combined calls", now.num_combined_calls - since_.num_combined_calls},
    };
    std::string out;
    for (const auto& c : counts) {
      if (c.count == 0) continue;
      out += (out.empty() ? "" : ", ") + std::to_string(c.count) + " " + c.what;
    }
    // Arenas stay once made (by threads that contended in an earlier
    // pattern, or --premade-arenas), and with several every call publishes
    // to the device's counts and none takes the lock-free repeat (Note
    // [arenas]): the report says so.
    const std::string arenas =
        arenas_at_start_ > 1 ? std::to_string(arenas_at_start_) + " arenas when timing began" : std::string();
    if (out.empty()) return arenas;
    // Peaks are not reset per pattern (stitching reads the allocation peak),
    // so these cover every pattern of the run so far.
    const auto peak = [&](const stat_array& s) {
      return format_bytes(static_cast<std::size_t>(at(s, stat_type::all).peak));
    };
    return "peak allocated " + peak(now.allocated_bytes) + " and peak reserved " + peak(now.reserved_bytes) +
           " since the run began; " + out + " in the timed repetitions" + (arenas.empty() ? "" : "; " + arenas);
  }

  device_allocator allocator_;
  device_stats since_;  // at timing_starts
  int arenas_at_start_ = 1;
  bool timed_ = false;
  std::string device_work_;
};

}  // namespace

std::unique_ptr<bench_allocator> make_streamalloc_adaptor(bench_device& device, const allocator_config& config) {
  return std::make_unique<streamalloc_adaptor>(device, config);
}

}  // namespace streamalloc::bench
