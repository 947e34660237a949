// [gpu][vmm] data integrity of the caching allocator on expandable segments:
// 10^5 random allocations, frees and cross-stream hand-offs on three streams
// under a 2 GiB cap. A kernel writes each block's own pattern when it is
// allocated or handed to another stream, and another checks it before it is
// freed, while stitching moves physical chunks under the blocks. Without a
// GPU (or without VMM support) every case skips visibly.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ios>
#include <memory>
#include <random>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "gpu/pattern_kernels.hpp"
#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

using namespace streamalloc;
using streamalloc::testing::launch_check_pattern;
using streamalloc::testing::launch_fill_pattern;
using streamalloc::testing::pattern_tally;
using streamalloc::testing::pattern_word;
using streamalloc::testing::test_buffer;
using streamalloc::testing::test_stream;

namespace {

constexpr auto k_all = static_cast<std::size_t>(stat_type::all);
constexpr int k_stream_count = 3;
// The memory-fraction cap. The live set swings up to near it, so requests
// regularly find no mapped free block that fits and chunks must move.
constexpr std::size_t k_cap_bytes = 2_GiB;
constexpr std::size_t k_min_bytes = 512;
constexpr std::size_t k_max_bytes = 32_MiB;
// Share of requests below 512 B with odd sizes (the kernels' tail bytes).
constexpr double k_tiny_share = 0.05;
// Share of steps that move a live block to another stream.
constexpr double k_hand_off_share = 0.05;
// Steps between synchronizations that read the mismatch counter.
constexpr std::size_t k_check_every_ops = 1000;
// Steps for one rise and fall of the target live bytes: the falls leave
// holes, the rises need memory the holes have.
constexpr std::size_t k_wave_ops = 10000;
constexpr double k_low_target = 0.25;
constexpr double k_high_target = 0.95;

struct workload {
  bool stitching = true;
  std::size_t ops = 0;
  std::uint64_t seed = 0;
};

struct live_block {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  std::uint32_t key = 0;
  int stream = 0;  // index of the stream that last wrote it
};

struct run_counts {
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t hand_offs = 0;
  std::size_t ooms = 0;
  std::size_t peak_live_bytes = 0;
  unsigned long long checked_bytes = 0;  // what the check kernels must report
};

// A cudaEvent_t without timing, destroyed at scope exit.
class test_event {
 public:
  test_event() {
    if (cudaEventCreateWithFlags(&event_, cudaEventDisableTiming) != cudaSuccess) event_ = nullptr;
  }
  ~test_event() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }
  test_event(const test_event&) = delete;
  test_event& operator=(const test_event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// make_cuda_backend(0), or nullptr after a visible skip when device 0 has
// no virtual memory management (then the allocator has no expandable
// segments to test).
std::unique_ptr<device_backend> vmm_backend_or_skip() {
  status error;
  std::unique_ptr<device_backend> backend = make_cuda_backend(0, &error);
  INFO(error.message());
  REQUIRE(backend != nullptr);
  if (!backend->supports_virtual_memory()) {
    WARN("skipped: CUDA device 0 does not support virtual memory management");
    return nullptr;
  }
  return backend;
}

// Drives one allocator through a seeded random workload, launching the
// fill and check kernels the way a program uses its tensors: each block is
// written on the stream it was allocated on, a block moved to another
// stream is ordered after its last writer and marked with record_stream,
// and a block is freed right after its check is queued (so the free races
// the check unless the allocator waits for it).
class integrity_run {
 public:
  integrity_run(caching_allocator& allocator, const std::array<test_stream, k_stream_count>& streams,
                pattern_tally* tally, cudaEvent_t hand_off_event, std::uint64_t seed)
      : allocator_(allocator), streams_(streams), tally_(tally), hand_off_event_(hand_off_event), rng_(seed) {}

  void run(std::size_t ops) {
    for (std::size_t op = 0; op < ops; ++op) {
      step(op);
      if ((op + 1) % k_check_every_ops == 0) {
        INFO("after op " << op);
        verify_device();
      }
    }
    verify_device();
  }

  void free_everything() {
    while (!live_.empty()) free_at(live_.size() - 1);
    verify_device();
  }

  const run_counts& counts() const { return counts_; }

 private:
  cudaStream_t stream(int index) const { return streams_[static_cast<std::size_t>(index)].get(); }
  stream_handle handle(int index) const { return streams_[static_cast<std::size_t>(index)].handle(); }

  void step(std::size_t op) {
    // A triangle wave between the low and the high target live bytes.
    const double phase = static_cast<double>(op % k_wave_ops) / static_cast<double>(k_wave_ops);
    const double rise = phase < 0.5 ? 2.0 * phase : 2.0 - 2.0 * phase;
    const double target = (k_low_target + (k_high_target - k_low_target) * rise) * static_cast<double>(k_cap_bytes);

    std::uniform_real_distribution<double> unit(0.0, 1.0);
    if (!live_.empty() && unit(rng_) < k_hand_off_share) {
      hand_off(pick());
      return;
    }
    const double allocate_share = static_cast<double>(live_bytes_) < target ? 0.7 : 0.3;
    if (live_.empty() || unit(rng_) < allocate_share) {
      allocate_one();
    } else {
      free_at(pick());
    }
  }

  std::size_t pick() { return std::uniform_int_distribution<std::size_t>(0, live_.size() - 1)(rng_); }

  std::size_t random_size() {
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    if (unit(rng_) < k_tiny_share) return std::uniform_int_distribution<std::size_t>(1, k_min_bytes - 1)(rng_);
    // Log-uniform, so small and large requests are both common.
    const double low = std::log(static_cast<double>(k_min_bytes));
    const double high = std::log(static_cast<double>(k_max_bytes));
    const auto bytes = static_cast<std::size_t>(std::exp(low + unit(rng_) * (high - low)));
    return std::clamp(bytes, k_min_bytes, k_max_bytes);
  }

  void allocate_one() {
    const std::size_t bytes = random_size();
    const int s = std::uniform_int_distribution<int>(0, k_stream_count - 1)(rng_);
    void* ptr = nullptr;
    bool out_of_memory_raised = false;
    try {
      ptr = allocator_.allocate(bytes, handle(s));
    } catch (const out_of_memory&) {
      out_of_memory_raised = true;
    }
    if (out_of_memory_raised) {
      ++counts_.ooms;
      relieve_pressure(bytes);
      return;
    }
    REQUIRE(ptr != nullptr);
    const live_block b{ptr, bytes, next_key_++, s};
    STREAMALLOC_CUDA_REQUIRE(launch_fill_pattern(b.ptr, b.bytes, b.key, stream(s)));
    live_.push_back(b);
    live_bytes_ += bytes;
    counts_.peak_live_bytes = std::max(counts_.peak_live_bytes, live_bytes_);
    ++counts_.allocations;
  }

  // After an out_of_memory: a quarter of the live blocks go, as a program
  // would drop tensors and retry.
  void relieve_pressure(std::size_t failed_bytes) {
    // With nothing live, a request this size must fit under the cap.
    INFO("out_of_memory for " << failed_bytes << " bytes with nothing allocated");
    REQUIRE(!live_.empty());
    const std::size_t count = std::max<std::size_t>(1, live_.size() / 4);
    for (std::size_t i = 0; i < count; ++i) free_at(pick());
  }

  void free_at(std::size_t index) {
    const live_block b = live_[index];
    STREAMALLOC_CUDA_REQUIRE(launch_check_pattern(b.ptr, b.bytes, b.key, tally_, stream(b.stream)));
    counts_.checked_bytes += b.bytes;
    allocator_.free(b.ptr);
    live_[index] = live_.back();
    live_.pop_back();
    live_bytes_ -= b.bytes;
    ++counts_.frees;
  }

  // The block's next writer is another stream: it waits for the last
  // writer, checks what that one wrote and writes a new pattern. The block
  // is then freed later on a stream it was not allocated on, which makes
  // the free pending until that stream's work is done.
  void hand_off(std::size_t index) {
    live_block& b = live_[index];
    const int to = (b.stream + 1 + std::uniform_int_distribution<int>(0, k_stream_count - 2)(rng_)) % k_stream_count;
    STREAMALLOC_CUDA_REQUIRE(cudaEventRecord(hand_off_event_, stream(b.stream)));
    STREAMALLOC_CUDA_REQUIRE(cudaStreamWaitEvent(stream(to), hand_off_event_, 0));
    allocator_.record_stream(b.ptr, handle(to));
    STREAMALLOC_CUDA_REQUIRE(launch_check_pattern(b.ptr, b.bytes, b.key, tally_, stream(to)));
    counts_.checked_bytes += b.bytes;
    b.key = next_key_++;
    STREAMALLOC_CUDA_REQUIRE(launch_fill_pattern(b.ptr, b.bytes, b.key, stream(to)));
    b.stream = to;
    ++counts_.hand_offs;
  }

  // Waits for every queued kernel, then: no check found a wrong word, the
  // checks together covered every byte they were given, and the
  // allocator's invariants hold.
  void verify_device() {
    STREAMALLOC_CUDA_REQUIRE(cudaDeviceSynchronize());
    pattern_tally seen{};
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(&seen, tally_, sizeof seen, cudaMemcpyDeviceToHost));
    INFO("first mismatch: key " << seen.sample_key << ", word " << seen.sample_word << ", expected 0x" << std::hex
                                << seen.sample_expected << ", found 0x" << seen.sample_actual);
    REQUIRE(seen.mismatched_words == 0);
    REQUIRE(seen.checked_bytes == counts_.checked_bytes);
    REQUIRE_NOTHROW(allocator_.validate());
  }

  caching_allocator& allocator_;
  const std::array<test_stream, k_stream_count>& streams_;
  pattern_tally* tally_;
  cudaEvent_t hand_off_event_;
  std::mt19937_64 rng_;
  std::vector<live_block> live_;
  std::size_t live_bytes_ = 0;
  std::uint32_t next_key_ = 1;
  run_counts counts_;
};

// Runs `w` on device 0 and checks data integrity throughout; returns the
// allocator's stats once everything is freed (before empty_cache), after
// checking that empty_cache then returns every byte. `ran` is false when
// the case skipped.
device_stats run_integrity_case(const workload& w, bool* ran) {
  *ran = false;
  const std::unique_ptr<device_backend> backend = vmm_backend_or_skip();
  if (backend == nullptr) return {};
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STREAMALLOC_CUDA_REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < k_cap_bytes + k_cap_bytes / 2) {
    WARN("skipped: device 0 has " << format_bytes(free_bytes) << " free; the run needs "
                                  << format_bytes(k_cap_bytes + k_cap_bytes / 2));
    return {};
  }

  allocator_config config;
  config.stitching = w.stitching;
  config.memory_fraction = static_cast<double>(k_cap_bytes) / static_cast<double>(total_bytes);
  const std::array<test_stream, k_stream_count> streams;
  for (const test_stream& s : streams) REQUIRE(s.get() != nullptr);
  const test_event hand_off_event;
  REQUIRE(hand_off_event.get() != nullptr);
  const test_buffer tally(sizeof(pattern_tally));
  REQUIRE(tally.get() != nullptr);
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(tally.get(), 0, sizeof(pattern_tally)));
  STREAMALLOC_CUDA_REQUIRE(cudaDeviceSynchronize());

  caching_allocator allocator(*backend, config);
  const auto started = std::chrono::steady_clock::now();
  integrity_run run(allocator, streams, static_cast<pattern_tally*>(tally.get()), hand_off_event.get(), w.seed);
  run.run(w.ops);
  const device_stats during = allocator.stats();
  run.free_everything();
  const device_stats freed = allocator.stats();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  const run_counts& c = run.counts();
  WARN("vmm integrity (stitching " << (w.stitching ? "on" : "off") << ", seed " << w.seed << "): " << w.ops
                                   << " ops in " << seconds << " s; " << c.allocations << " allocations, " << c.frees
                                   << " frees, " << c.hand_offs << " hand-offs, " << c.ooms << " OOMs; checked "
                                   << format_bytes(static_cast<std::size_t>(c.checked_bytes)) << "; peak live "
                                   << format_bytes(c.peak_live_bytes) << ", peak reserved "
                                   << format_bytes(static_cast<std::size_t>(freed.reserved_bytes[k_all].peak))
                                   << " (cap " << format_bytes(k_cap_bytes) << "); chunks mapped peak "
                                   << freed.mapped_chunks.peak << ", maps " << freed.num_chunk_maps << ", unmaps "
                                   << freed.num_chunk_unmaps << ", stitched blocks " << freed.num_stitched_blocks
                                   << ", stitch syncs " << freed.num_stitch_syncs << ", device syncs "
                                   << freed.num_sync_all_streams << ", cross-stream reuses "
                                   << freed.num_cross_stream_reuses << ", alloc retries " << freed.num_alloc_retries);

  // The workload did what it is for: blocks moved between streams, memory
  // came from mapped chunks, the live set pressed against the cap, and
  // reserved memory never went over it.
  CHECK(c.hand_offs > 0);
  CHECK(c.allocations > w.ops / 4);
  CHECK(during.num_chunk_maps > 0);
  CHECK(c.peak_live_bytes >= k_cap_bytes / 4 * 3);
  CHECK(freed.reserved_bytes[k_all].peak <= static_cast<std::int64_t>(k_cap_bytes));
  CHECK(freed.allocated_bytes[k_all].current == 0);
  CHECK(freed.allocation[k_all].current == 0);

  allocator.empty_cache();
  const device_stats emptied = allocator.stats();
  REQUIRE_NOTHROW(allocator.validate());
  CHECK(emptied.reserved_bytes[k_all].current == 0);
  CHECK(emptied.mapped_chunks.current == 0);
  CHECK(emptied.segment[k_all].current == 0);
  // Every chunk mapped during the run was unmapped again.
  CHECK(emptied.num_chunk_unmaps == emptied.num_chunk_maps);
  *ran = true;
  return freed;
}

}  // namespace

TEST_CASE("vmm integrity: pattern kernels cover every byte and count corrupted words", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  const test_stream stream;
  REQUIRE(stream.get() != nullptr);
  const test_buffer tally(sizeof(pattern_tally));
  REQUIRE(tally.get() != nullptr);
  auto* device_tally = static_cast<pattern_tally*>(tally.get());
  const test_buffer data(1_MiB + 16);
  REQUIRE(data.get() != nullptr);
  auto* bytes_at = static_cast<unsigned char*>(data.get());

  const std::uint32_t key = 77;
  for (const std::size_t bytes : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{7}, std::size_t{4099},
                                  1_MiB + 5}) {
    CAPTURE(bytes);
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(tally.get(), 0, sizeof(pattern_tally)));
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(data.get(), 0, data.bytes()));
    STREAMALLOC_CUDA_REQUIRE(cudaDeviceSynchronize());
    STREAMALLOC_CUDA_REQUIRE(launch_fill_pattern(data.get(), bytes, key, stream.get()));
    STREAMALLOC_CUDA_REQUIRE(launch_check_pattern(data.get(), bytes, key, device_tally, stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
    pattern_tally seen{};
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(&seen, tally.get(), sizeof seen, cudaMemcpyDeviceToHost));
    CHECK(seen.mismatched_words == 0);
    CHECK(seen.checked_bytes == bytes);
    CHECK(seen.sample_taken == 0);

    // The device wrote the host's pattern into exactly `bytes` bytes.
    std::vector<unsigned char> host(bytes + 4);
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(host.data(), data.get(), host.size(), cudaMemcpyDeviceToHost));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < bytes; ++i) {
      const auto expected = static_cast<unsigned char>(pattern_word(key, i / 4) >> (8 * (i % 4)));
      if (host[i] != expected) ++wrong;
    }
    CHECK(wrong == 0);
    for (std::size_t i = bytes; i < host.size(); ++i) CHECK(host[i] == 0);

    // A flipped first and last byte: one wrong word each (one in all when
    // they share a word); another key's check finds nearly every word wrong.
    const auto flipped_first = static_cast<unsigned char>(~host[0]);
    const auto flipped_last = static_cast<unsigned char>(~host[bytes - 1]);
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(bytes_at, flipped_first, 1));
    if (bytes > 1) STREAMALLOC_CUDA_REQUIRE(cudaMemset(bytes_at + bytes - 1, flipped_last, 1));
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(tally.get(), 0, sizeof(pattern_tally)));
    STREAMALLOC_CUDA_REQUIRE(cudaDeviceSynchronize());
    STREAMALLOC_CUDA_REQUIRE(launch_check_pattern(data.get(), bytes, key, device_tally, stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(&seen, tally.get(), sizeof seen, cudaMemcpyDeviceToHost));
    const std::size_t words = (bytes + 3) / 4;
    CHECK(seen.mismatched_words == (words == 1 ? 1u : 2u));
    CHECK(seen.sample_taken == 1);
    CHECK(seen.sample_key == key);
    CHECK((seen.sample_word == 0 || seen.sample_word == words - 1));

    STREAMALLOC_CUDA_REQUIRE(launch_fill_pattern(data.get(), bytes, key, stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaMemsetAsync(tally.get(), 0, sizeof(pattern_tally), stream.get()));
    STREAMALLOC_CUDA_REQUIRE(launch_check_pattern(data.get(), bytes, key + 1, device_tally, stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(&seen, tally.get(), sizeof seen, cudaMemcpyDeviceToHost));
    CHECK(seen.mismatched_words + 1 >= words);
    CHECK(seen.checked_bytes == bytes);
  }
  CHECK(launch_fill_pattern(bytes_at + 1, 8, key, stream.get()) == cudaErrorInvalidValue);
  CHECK(launch_check_pattern(data.get(), 8, key, nullptr, stream.get()) == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("vmm integrity: 10^5 random ops with stitching keep every block's data", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  workload w;
  w.stitching = true;
  w.ops = 100000;
  w.seed = 0x5eed0001;
  bool ran = false;
  const device_stats freed = run_integrity_case(w, &ran);
  if (!ran) return;
  // Chunks really moved: blocks were served by stitched chunks, which were
  // unmapped from holes while the run went on.
  CHECK(freed.num_stitched_blocks > 0);
  CHECK(freed.num_chunk_unmaps > 0);
  CHECK(freed.num_stitch_syncs > 0);
}

TEST_CASE("vmm integrity: growth and empty_cache without stitching keep every block's data", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  workload w;
  w.stitching = false;
  w.ops = 30000;
  w.seed = 0x5eed0002;
  bool ran = false;
  const device_stats freed = run_integrity_case(w, &ran);
  if (!ran) return;
  CHECK(freed.num_stitched_blocks == 0);
  CHECK(freed.num_stitch_syncs == 0);
  // Near the cap, idle chunks went back to the device to make room.
  CHECK(freed.num_chunk_unmaps > 0);
}
