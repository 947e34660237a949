// [gpu] the caching allocator on CUDA under threads that each work on a
// stream of their own, so that calls which find the lock taken are run by
// another thread's hold of it (Note [combined calls]) while cross-stream
// hand-offs and stitching move memory between the streams. Each block gets
// its own pattern from a kernel when it is allocated and is checked by
// another just before it is freed: no word may differ, every byte must be
// checked, and the allocator must end consistent and empty. The same runs
// on a device_allocator whose threads are spread over four arenas (Note
// [arenas]). Without a GPU the cases skip visibly.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "gpu/pattern_kernels.hpp"
#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/util/bytes.hpp"

using namespace streamalloc;
using streamalloc::testing::launch_check_pattern;
using streamalloc::testing::launch_fill_pattern;
using streamalloc::testing::pattern_tally;
using streamalloc::testing::test_buffer;
using streamalloc::testing::test_stream;

namespace {

constexpr auto k_all = static_cast<std::size_t>(stat_type::all);
constexpr int k_threads = 8;
constexpr int k_ops_per_thread = 4000;
constexpr std::size_t k_max_live_per_thread = 32;
constexpr std::size_t k_min_bytes = 512;
constexpr std::size_t k_max_bytes = 16_MiB;

struct live_block {
  void* ptr;
  std::size_t bytes;
  std::uint32_t key;
};

// One thread's work: random allocations (log-uniform sizes, each filled on
// the thread's stream) and frees (each checked on that stream first).
// Returns the bytes its check kernels must report; failures go to `error`.
template <typename allocator_type>
unsigned long long run_thread(allocator_type& allocator, const test_stream& stream, pattern_tally* tally,
                              int thread, std::string* error) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(thread) * 104729 + 7);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(k_min_bytes)),
                                                  std::log(static_cast<double>(k_max_bytes)));
  std::vector<live_block> live;
  unsigned long long checked = 0;
  std::uint32_t next_key = static_cast<std::uint32_t>(thread) << 24;
  const auto free_one = [&](std::size_t i) {
    const live_block b = live[i];
    live[i] = live.back();
    live.pop_back();
    if (launch_check_pattern(b.ptr, b.bytes, b.key, tally, stream.get()) != cudaSuccess) {
      *error = "check launch failed";
      return false;
    }
    checked += b.bytes;
    allocator.free(b.ptr);
    return true;
  };
  try {
    for (int op = 0; op < k_ops_per_thread; ++op) {
      if (live.size() < k_max_live_per_thread && (live.empty() || rng() % 2 == 0)) {
        const auto bytes = static_cast<std::size_t>(std::exp(log_size(rng))) / 4 * 4;
        void* ptr = allocator.allocate(bytes, stream.handle());
        const std::uint32_t key = ++next_key;
        if (launch_fill_pattern(ptr, bytes, key, stream.get()) != cudaSuccess) {
          *error = "fill launch failed";
          return checked;
        }
        live.push_back({ptr, bytes, key});
      } else if (!free_one(rng() % live.size())) {
        return checked;
      }
    }
    while (!live.empty()) {
      if (!free_one(live.size() - 1)) return checked;
    }
    if (cudaStreamSynchronize(stream.get()) != cudaSuccess) *error = "stream synchronization failed";
  } catch (const std::exception& e) {
    *error = std::string("thread threw: ") + e.what();
  }
  return checked;
}

// The threads on `allocator`; with `spread`, thread t first moves to
// arena t % 4 of the device_allocator.
template <typename allocator_type>
void check_threads_keep_data(allocator_type& allocator, bool spread) {
  static_cast<void>(spread);  // caching_allocator has one arena
  std::vector<std::unique_ptr<test_stream>> streams;
  std::vector<std::unique_ptr<test_buffer>> tallies;
  for (int t = 0; t < k_threads; ++t) {
    streams.push_back(std::make_unique<test_stream>());
    REQUIRE(streams.back()->get() != nullptr);
    tallies.push_back(std::make_unique<test_buffer>(sizeof(pattern_tally)));
    REQUIRE(tallies.back()->get() != nullptr);
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(tallies.back()->get(), 0, sizeof(pattern_tally)));
  }
  std::vector<std::string> errors(k_threads);
  std::vector<unsigned long long> expected_checked(k_threads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] {
      if constexpr (std::is_same_v<allocator_type, device_allocator>) {
        if (spread) allocator.move_this_thread(t % device_allocator::k_max_arenas);
      }
      expected_checked[static_cast<std::size_t>(t)] =
          run_thread(allocator, *streams[static_cast<std::size_t>(t)],
                     static_cast<pattern_tally*>(tallies[static_cast<std::size_t>(t)]->get()), t,
                     &errors[static_cast<std::size_t>(t)]);
    });
  }
  for (std::thread& thread : threads) thread.join();
  STREAMALLOC_CUDA_REQUIRE(cudaDeviceSynchronize());

  for (int t = 0; t < k_threads; ++t) {
    CAPTURE(t);
    CHECK(errors[static_cast<std::size_t>(t)].empty());
    INFO(errors[static_cast<std::size_t>(t)]);
    pattern_tally tally{};
    STREAMALLOC_CUDA_REQUIRE(
        cudaMemcpy(&tally, tallies[static_cast<std::size_t>(t)]->get(), sizeof(tally), cudaMemcpyDeviceToHost));
    CHECK(tally.mismatched_words == 0);
    CHECK(tally.checked_bytes == expected_checked[static_cast<std::size_t>(t)]);
    CHECK(expected_checked[static_cast<std::size_t>(t)] > 0);
  }
  allocator.validate();
  const device_stats stats = allocator.stats();
  INFO("calls combined: " << stats.num_combined_calls << ", cross-stream hand-offs: "
                          << stats.num_cross_stream_reuses << ", chunk maps: " << stats.num_chunk_maps);
  CHECK(stats.allocated_bytes[k_all].current == 0);
  CHECK(stats.allocation[k_all].current == 0);
  allocator.empty_cache();
  CHECK(allocator.stats().reserved_bytes[k_all].current == 0);
}

std::unique_ptr<device_backend> cuda_device_0() {
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  status backend_error;
  std::unique_ptr<device_backend> backend = make_cuda_backend(0, &backend_error);
  INFO(backend_error.message());
  REQUIRE(backend != nullptr);
  return backend;
}

}  // namespace

TEST_CASE("caching allocator on CUDA: threads on streams of their own keep every block's data", "[gpu][threads]") {
  STREAMALLOC_REQUIRE_GPU();
  std::unique_ptr<device_backend> backend = cuda_device_0();
  caching_allocator allocator(*backend, allocator_config{});
  check_threads_keep_data(allocator, false);
}

TEST_CASE("device allocator on CUDA: threads over four arenas keep every block's data", "[gpu][threads][arenas]") {
  STREAMALLOC_REQUIRE_GPU();
  std::unique_ptr<device_backend> backend = cuda_device_0();
  device_allocator allocator(*backend, allocator_config{});
  check_threads_keep_data(allocator, true);
  CHECK(allocator.arena_count() == device_allocator::k_max_arenas);
}
