// Note [repeats without the lock] on the simulated device: a loop that
// frees a block and asks for the same bytes again runs without critical
// sections once its chain is armed, while readers, other requests, second
// frees and other threads see an allocator that freed and allocated as
// usual.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

const stat_counter& all_of(const stat_array& a) { return at(a, stat_type::all); }

// Allocates `bytes` on `stream` and frees it three times: the third
// request is the recent free's reuse that arms the chain; returns it, still
// allocated.
void* arm_chain(sim_fixture& f, std::size_t bytes, stream_handle stream) {
  void* p = f.alloc.allocate(bytes, stream);
  f.alloc.free(p);
  void* q = f.alloc.allocate(bytes, stream);
  REQUIRE(q == p);
  return q;
}

}  // namespace

TEST_CASE("repeats without the lock: a same-size loop begins no critical section", "[repeats]") {
  for (const bool vmm : {true, false}) {
    for (const std::size_t bytes : {std::size_t{256}, std::size_t{64_KiB}, std::size_t{4_MiB}, std::size_t{64_MiB}}) {
      INFO((vmm ? "expandable segments, " : "plain segments, ") << bytes << " B");
      sim_fixture f(vmm ? vmm_device() : plain_device());
      void* p = arm_chain(f, bytes, f.s1);
      const std::uint64_t sections = f.alloc.critical_sections();
      for (int i = 0; i < 1000; ++i) {
        f.alloc.free(p);
        REQUIRE(f.alloc.allocate(bytes, f.s1) == p);
      }
      CHECK(f.alloc.critical_sections() == sections);
      // 1002 allocations and 1001 frees, as through the lock; the reader
      // counts the thousand reuses.
      const device_stats st = f.stats();
      CHECK(st.num_recent_reuses == 1001);
      CHECK(all(st.allocation) == 1);
      CHECK(all_of(st.allocation).allocated == 1002);
      CHECK(all_of(st.allocation).freed == 1001);
      CHECK(all_of(st.active).allocated == 1002);
      const std::int64_t block_bytes = all(st.allocated_bytes);
      CHECK(all_of(st.allocated_bytes).allocated == 1002 * block_bytes);
      CHECK(all_of(st.active_bytes).freed == 1001 * block_bytes);
      CHECK(all_of(st.requested_bytes).allocated == 1002 * static_cast<std::int64_t>(bytes));
      CHECK(all(st.requested_bytes) == static_cast<std::int64_t>(bytes));
      const stat_type pool = bytes <= 1_MiB ? stat_type::small_pool : stat_type::large_pool;
      CHECK(at(st.allocation, pool).allocated == 1002);
      f.check_consistent();
      f.alloc.free(p);
      f.check_consistent();
    }
  }
}

TEST_CASE("repeats without the lock: readers see a parked free as freed", "[repeats]") {
  sim_fixture f(vmm_device());
  void* p = arm_chain(f, 64_KiB, f.s1);
  const std::uint64_t sections = f.alloc.critical_sections();
  f.alloc.free(p);  // parked
  CHECK(f.alloc.critical_sections() == sections);
  // current_usage leaves it out without freeing it.
  CHECK(f.alloc.current_usage().allocations == 0);
  CHECK(f.alloc.current_usage().allocated_bytes == 0);
  CHECK(f.alloc.current_usage().requested_bytes == 0);
  CHECK_NOTHROW(f.alloc.validate());
  // stats() frees it first.
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == 0);
  CHECK(all(st.allocated_bytes) == 0);
  CHECK(all(st.requested_bytes) == 0);
  CHECK(all_of(st.allocation).freed == 2);
  CHECK_FALSE(f.alloc.owns(p));
  f.check_consistent();
}

TEST_CASE("repeats without the lock: a second free of a parked block is reported", "[repeats]") {
  sim_fixture f(vmm_device());
  void* p = arm_chain(f, 4_MiB, f.s1);
  f.alloc.free(p);
  std::string message;
  try {
    f.alloc.free(p);
  } catch (const usage_error& e) {
    message = e.what();
  }
  CHECK_FALSE(message.empty());
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == 0);
  CHECK(all_of(st.allocation).freed == 2);
  f.check_consistent();
}

TEST_CASE("repeats without the lock: another request, stream or reader ends the chain", "[repeats]") {
  sim_fixture f(vmm_device());
  SECTION("a request for other bytes frees the parked block first and places as usual") {
    void* p = arm_chain(f, 64_KiB, f.s1);
    f.alloc.free(p);
    const std::uint64_t sections = f.alloc.critical_sections();
    // Same rounded size, other requested bytes: through the lock.
    void* q = f.alloc.allocate(64_KiB - 100, f.s1);
    CHECK(f.alloc.critical_sections() > sections);
    CHECK(q == p);
    CHECK(f.stats().requested_bytes[0].current == static_cast<std::int64_t>(64_KiB - 100));
    f.alloc.free(q);
  }
  SECTION("a request on another stream") {
    void* p = arm_chain(f, 64_KiB, f.s1);
    f.alloc.free(p);
    const std::uint64_t sections = f.alloc.critical_sections();
    void* q = f.alloc.allocate(64_KiB, f.s2);
    CHECK(f.alloc.critical_sections() > sections);
    f.alloc.free(q);
  }
  SECTION("a reader between the free and the request") {
    void* p = arm_chain(f, 64_KiB, f.s1);
    f.alloc.free(p);
    (void)f.alloc.stats();
    const std::uint64_t sections = f.alloc.critical_sections();
    void* q = f.alloc.allocate(64_KiB, f.s1);
    CHECK(f.alloc.critical_sections() > sections);
    CHECK(q == p);
    f.alloc.free(q);
  }
  SECTION("another block's free between the loop's free and its request") {
    void* other = f.alloc.allocate(1_MiB, f.s1);
    void* p = arm_chain(f, 64_KiB, f.s1);
    f.alloc.free(p);
    f.alloc.free(other);
    const std::uint64_t sections = f.alloc.critical_sections();
    void* q = f.alloc.allocate(64_KiB, f.s1);
    CHECK(f.alloc.critical_sections() > sections);
    f.alloc.free(q);
  }
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == 0);
  CHECK(all_of(st.allocation).allocated == all_of(st.allocation).freed);
  CHECK(all_of(st.requested_bytes).allocated == all_of(st.requested_bytes).freed);
  f.check_consistent();
}

TEST_CASE("repeats without the lock: a loop beside a thread that allocates, frees and reads", "[threads][repeats]") {
  sim_fixture f(vmm_device());
  constexpr int k_loop_pairs = 20000;
  constexpr std::size_t k_loop_bytes = 96_KiB;
  std::atomic<bool> looping{true};
  bool reader_saw_too_few = false;  // Catch's assertions stay on the test's thread
  std::int64_t other_allocations = 0;
  std::int64_t other_requested = 0;
  std::thread other([&] {
    std::vector<void*> live;
    std::uint64_t state = 7;
    while (looping.load(std::memory_order_relaxed)) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const std::size_t bytes = 512 + (state >> 33) % (3_MiB);
      if (live.size() < 16 && (state & 1) != 0) {
        live.push_back(f.alloc.allocate(bytes, (state & 2) != 0 ? f.s1 : f.s2));
        ++other_allocations;
        other_requested += static_cast<std::int64_t>(bytes);
      } else if (!live.empty()) {
        f.alloc.free(live.back());
        live.pop_back();
      }
      if ((state & 0x1c) == 0) {
        const device_stats st = f.alloc.stats();
        if (all(st.allocation) < static_cast<std::int64_t>(live.size())) reader_saw_too_few = true;
      }
    }
    for (void* p : live) f.alloc.free(p);
  });
  std::int64_t loop_allocations = 0;
  for (int i = 0; i < k_loop_pairs; ++i) {
    void* p = f.alloc.allocate(k_loop_bytes, f.s1);
    ++loop_allocations;
    f.alloc.free(p);
  }
  looping.store(false);
  other.join();
  CHECK_FALSE(reader_saw_too_few);
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == 0);
  CHECK(all_of(st.allocation).allocated == loop_allocations + other_allocations);
  CHECK(all_of(st.allocation).freed == loop_allocations + other_allocations);
  CHECK(all_of(st.requested_bytes).allocated ==
        loop_allocations * static_cast<std::int64_t>(k_loop_bytes) + other_requested);
  f.check_consistent();
}

TEST_CASE("repeats without the lock: loops on several threads end with nothing allocated", "[threads][repeats]") {
  // Each thread repeats its own size on one of two streams, with a stats read
  // now and then: arming, parking and taking back race on the one slot.
  sim_fixture f(vmm_device());
  constexpr int k_threads = 4;
  constexpr int k_pairs = 20000;
  const stream_handle streams[k_threads] = {f.s1, f.s2, f.s1, f.s2};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&f, &streams, t] {
      const std::size_t bytes = (1 + static_cast<std::size_t>(t)) * 64_KiB;
      for (int i = 0; i < k_pairs; ++i) {
        void* p = f.alloc.allocate(bytes, streams[t]);
        f.alloc.free(p);
        if (i % 1000 == 999) (void)f.alloc.stats();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == 0);
  CHECK(all(st.requested_bytes) == 0);
  CHECK(all_of(st.allocation).allocated == k_threads * k_pairs);
  CHECK(all_of(st.allocation).freed == k_threads * k_pairs);
  f.check_consistent();
}
