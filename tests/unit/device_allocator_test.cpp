// device_allocator on the simulated device: arenas (Note [arenas] in
// device_allocator.cpp). One arena behaves as one caching_allocator; with
// several, frees find their arena from any thread, the device's counts and
// peaks are of the sum, the memory-fraction cap and the garbage-collection
// threshold hold for the device, an arena out of memory takes the others'
// cached memory (their recent frees included), captures route every
// allocation to arena 0, threads under lasting contention move, and what a
// reader thread sees while arenas allocate holds.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/trace.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/recount.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::all;
using streamalloc::test::check_snapshot_shape;
using streamalloc::test::consistency_problem;
using streamalloc::test::immediate_events;
using streamalloc::test::manual_events;
using streamalloc::test::plain_device;
using streamalloc::test::vmm_device;

namespace {

std::int64_t peak(const stat_array& a) { return a[static_cast<int>(stat_type::all)].peak; }

void require_consistent(const device_allocator& alloc, const sim_backend& sim) {
  const std::string problem = consistency_problem(alloc, sim);
  INFO(problem);
  REQUIRE(problem.empty());
}

// `body(sim, alloc, stream)` on a fresh plain device and on a fresh one with
// virtual memory, each of `capacity` bytes.
template <typename fn>
void on_plain_and_vmm(std::size_t capacity, const allocator_config& config, fn&& body) {
  for (const bool vmm : {false, true}) {
    CAPTURE(vmm);
    sim_backend sim(vmm ? vmm_device(capacity) : plain_device(capacity));
    device_allocator alloc(sim, config);
    body(sim, alloc, sim.new_stream());
  }
}

// What any reader may expect of stats() read while threads allocate; empty
// when it holds.
std::string stats_read_problem(const device_stats& st) {
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    for (const stat_counter& c : st.*array) {
      if (c.current < 0) return "a current count below zero: " + std::to_string(c.current);
      if (c.current > c.peak) {
        return "a current count above its peak: " + std::to_string(c.current) + " > " + std::to_string(c.peak);
      }
    }
  }
  if (all(st.allocated_bytes) > all(st.reserved_bytes)) {
    return "allocated " + std::to_string(all(st.allocated_bytes)) + " above reserved " +
           std::to_string(all(st.reserved_bytes));
  }
  if (all(st.allocated_bytes) > all(st.active_bytes)) {
    return "allocated " + std::to_string(all(st.allocated_bytes)) + " above active " +
           std::to_string(all(st.active_bytes));
  }
  return {};
}

}  // namespace

TEST_CASE("device_allocator: one arena until a thread moves, with arena 0's numbers", "[arenas]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  void* p = alloc.allocate(3_MiB, s);
  alloc.free(p);
  void* q = alloc.allocate(1_KiB, s);
  REQUIRE(alloc.arena_count() == 1);
  REQUIRE(alloc.arena_of_this_thread() == 0);
  const device_stats device = alloc.stats();
  const device_stats first = alloc.arena(0).stats();
  REQUIRE(device.to_map() == first.to_map());
  alloc.free(q);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: a free reaches the owning arena from any thread", "[arenas]") {
  on_plain_and_vmm(80_GiB, allocator_config{}, [](sim_backend& sim, device_allocator& alloc, stream_handle s) {
    alloc.move_this_thread(1);
    REQUIRE(alloc.arena_count() == 2);
    void* in_one = alloc.allocate(5_MiB, s);
    REQUIRE(alloc.arena(1).owns(in_one));
    REQUIRE_FALSE(alloc.arena(0).owns(in_one));
    REQUIRE(alloc.owns(in_one));
    REQUIRE(alloc.allocation_size(in_one) >= 5_MiB);
    void* in_zero = nullptr;
    std::thread other([&] {
      REQUIRE(alloc.arena_of_this_thread() == 0);
      in_zero = alloc.allocate(2_MiB, s);
      alloc.free(in_one);  // arena 1's block, freed by a thread of arena 0
    });
    other.join();
    REQUIRE(alloc.arena(0).owns(in_zero));
    REQUIRE_FALSE(alloc.owns(in_one));
    alloc.free(in_zero);  // arena 0's block, freed from arena 1
    REQUIRE(all(alloc.stats().allocated_bytes) == 0);
    REQUIRE_THROWS_AS(alloc.free(in_zero), usage_error);
    require_consistent(alloc, sim);
  });
}

TEST_CASE("device_allocator: current and peak counts are of the sum over arenas", "[arenas]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  alloc.move_this_thread(1);
  alloc.move_this_thread(0);
  // 10 MiB live in arena 0, freed (a recent free, still counted there),
  // then 10 MiB in arena 1: the device never held 20 MiB.
  void* a = alloc.allocate(10_MiB, s);
  alloc.free(a);
  alloc.move_this_thread(1);
  void* b = alloc.allocate(10_MiB, s);
  device_stats st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == static_cast<std::int64_t>(10_MiB));
  REQUIRE(peak(st.allocated_bytes) == static_cast<std::int64_t>(10_MiB));
  REQUIRE(all(st.allocation) == 1);
  // Now both at once.
  alloc.move_this_thread(0);
  void* c = alloc.allocate(6_MiB, s);
  st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == static_cast<std::int64_t>(16_MiB));
  REQUIRE(peak(st.allocated_bytes) == static_cast<std::int64_t>(16_MiB));
  REQUIRE(all(st.reserved_bytes) ==
          all(alloc.arena(0).stats().reserved_bytes) + all(alloc.arena(1).stats().reserved_bytes));
  // Cumulative counts are the arenas' sums.
  REQUIRE(st.allocated_bytes[0].allocated ==
          alloc.arena(0).stats().allocated_bytes[0].allocated + alloc.arena(1).stats().allocated_bytes[0].allocated);
  alloc.free(b);
  alloc.free(c);
  st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == 0);
  REQUIRE(peak(st.allocated_bytes) == static_cast<std::int64_t>(16_MiB));
  alloc.reset_peak_stats();
  REQUIRE(peak(alloc.stats().allocated_bytes) == 0);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: a lone thread repeats without the lock beside other arenas", "[arenas][repeats]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  alloc.move_this_thread(1);
  // A free and a reuse of the same bytes arm arena 1's chain.
  void* p = alloc.allocate(10_MiB, s);
  alloc.free(p);
  REQUIRE(alloc.allocate(10_MiB, s) == p);
  const std::uint64_t sections = alloc.arena(1).critical_sections();
  for (int i = 0; i < 100; ++i) {
    alloc.free(p);
    REQUIRE(alloc.allocate(10_MiB, s) == p);
  }
  REQUIRE(alloc.arena(1).critical_sections() == sections);
  // Parked: freed, though arena 1 has published nothing since it armed.
  alloc.free(p);
  // Arena 0's 10 MiB would pass the device's peak if the parked block
  // counted; the crossing claims it, with no section of arena 1.
  alloc.move_this_thread(0);
  void* q = alloc.allocate(10_MiB, s);
  REQUIRE(alloc.arena(1).critical_sections() == sections);
  device_stats st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == static_cast<std::int64_t>(10_MiB));
  REQUIRE(peak(st.allocated_bytes) == static_cast<std::int64_t>(10_MiB));
  REQUIRE(all(st.allocation) == 1);
  // Both at once now.
  alloc.move_this_thread(1);
  void* r = alloc.allocate(10_MiB, s);
  st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == static_cast<std::int64_t>(20_MiB));
  REQUIRE(peak(st.allocated_bytes) == static_cast<std::int64_t>(20_MiB));
  // 103 allocations and 102 frees in arena 1, 1 allocation in arena 0.
  REQUIRE(st.allocation[0].allocated == 104);
  REQUIRE(st.allocation[0].freed == 102);
  alloc.free(r);
  alloc.free(q);
  require_consistent(alloc, sim);
  REQUIRE(all(alloc.stats().allocated_bytes) == 0);
}

// Threads on arenas 1-3 repeat a size without the lock, pausing while
// their block is parked, while a thread on arena 0 resets the peaks and
// grows past them (its crossings claim the parked blocks) and reads the
// totals (which claim too): the books must hold throughout and at the end.
TEST_CASE("device_allocator: claims of parked blocks race with repeats on other arenas", "[arenas][threads][repeats]") {
  sim_backend sim(vmm_device(8_GiB));
  device_allocator alloc(sim, allocator_config{});
  std::vector<stream_handle> streams;
  for (int i = 0; i < device_allocator::k_max_arenas; ++i) streams.push_back(sim.new_stream());
  std::atomic<bool> looping{true};
  std::atomic<std::int64_t> loop_allocations{0};
  std::vector<std::thread> loops;
  for (int t = 1; t < device_allocator::k_max_arenas; ++t) {
    loops.emplace_back([&, t] {
      alloc.move_this_thread(t);
      const std::size_t bytes = static_cast<std::size_t>(t) * 96_KiB;
      std::int64_t made = 0;
      while (looping.load(std::memory_order_relaxed)) {
        void* p = alloc.allocate(bytes, streams[static_cast<std::size_t>(t)]);
        ++made;
        alloc.free(p);
        for (volatile int spin = 0; spin < 200; spin = spin + 1) {
        }
      }
      loop_allocations += made;
    });
  }
  alloc.move_this_thread(0);
  std::string problem;  // Catch's assertions stay on this thread, checked below
  std::int64_t burst_allocations = 0;
  for (int round = 0; round < 2000 && problem.empty(); ++round) {
    alloc.reset_peak_stats();
    std::vector<void*> burst;
    std::int64_t held = 0;
    for (int k = 0; k <= round % 4; ++k) {
      burst.push_back(alloc.allocate((1 + static_cast<std::size_t>(k)) * 1_MiB, streams[0]));
      held += static_cast<std::int64_t>(alloc.allocation_size(burst.back()));
      ++burst_allocations;
    }
    const device_stats st = alloc.stats();
    problem = stats_read_problem(st);
    if (problem.empty() && (all(st.allocated_bytes) < held || peak(st.allocated_bytes) < held)) {
      problem = "the burst's " + std::to_string(held) + " bytes are not all counted";
    }
    for (void* b : burst) alloc.free(b);
  }
  looping.store(false);
  for (std::thread& th : loops) th.join();
  INFO(problem);
  REQUIRE(problem.empty());
  const device_stats st = alloc.stats();
  REQUIRE(all(st.allocated_bytes) == 0);
  REQUIRE(all(st.allocation) == 0);
  REQUIRE(st.allocation[0].allocated == loop_allocations.load() + burst_allocations);
  REQUIRE(st.allocation[0].freed == st.allocation[0].allocated);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: the memory fraction caps the device, not each arena", "[arenas]") {
  sim_backend sim(plain_device(100_MiB));
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  alloc.set_memory_fraction(0.5);
  void* a = alloc.allocate(30_MiB, s);
  alloc.move_this_thread(2);
  REQUIRE(alloc.memory_fraction() == 0.5);
  REQUIRE_THROWS_AS(alloc.allocate(30_MiB, s), out_of_memory);
  void* b = alloc.allocate(12_MiB, s);
  REQUIRE(all(alloc.stats().reserved_bytes) <= static_cast<std::int64_t>(50_MiB));
  REQUIRE(alloc.stats().num_ooms == 1);
  alloc.free(a);
  alloc.free(b);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: an arena out of memory takes the other arenas' cached memory", "[arenas]") {
  for (const bool vmm : {false, true}) {
    for (const int needy : {0, 1}) {  // before or after the arena holding the cache, in lock order
      CAPTURE(vmm, needy);
      sim_backend sim(vmm ? vmm_device(64_MiB) : plain_device(64_MiB));
      device_allocator alloc(sim, allocator_config{});
      const stream_handle s = sim.new_stream();
      alloc.move_this_thread(1 - needy);
      alloc.free(alloc.allocate(40_MiB, s));  // cached in the other arena
      REQUIRE(all(alloc.arena(1 - needy).stats().reserved_bytes) >= static_cast<std::int64_t>(40_MiB));
      alloc.move_this_thread(needy);
      void* p = alloc.allocate(40_MiB, s);
      REQUIRE(alloc.arena(needy).owns(p));
      REQUIRE(all(alloc.arena(1 - needy).stats().reserved_bytes) == 0);
      REQUIRE(alloc.stats().num_ooms == 0);
      alloc.free(p);
      require_consistent(alloc, sim);
    }
  }
}

TEST_CASE("device_allocator: under the fraction an arena takes another's cache, a block just freed included",
          "[arenas]") {
  on_plain_and_vmm(100_MiB, allocator_config{}, [](sim_backend& sim, device_allocator& alloc, stream_handle s) {
    alloc.move_this_thread(1);  // arena 1 exists before arena 0's free
    alloc.move_this_thread(0);
    alloc.free(alloc.allocate(30_MiB, s));  // among arena 0's recent frees
    alloc.set_memory_fraction(0.5);
    void* p = nullptr;
    std::thread other([&] {
      alloc.move_this_thread(1);
      p = alloc.allocate(40_MiB, s);
    });
    other.join();
    REQUIRE(alloc.arena(1).owns(p));
    REQUIRE(all(alloc.arena(0).stats().reserved_bytes) == 0);
    REQUIRE(all(alloc.stats().reserved_bytes) <= static_cast<std::int64_t>(50_MiB));
    REQUIRE(alloc.stats().num_ooms == 0);
    alloc.free(p);
    require_consistent(alloc, sim);
  });
}

TEST_CASE("device_allocator: garbage collection counts and collects every arena's cache", "[arenas]") {
  allocator_config config;
  config.garbage_collection_threshold = 0.5;
  on_plain_and_vmm(100_MiB, config, [](sim_backend& sim, device_allocator& alloc, stream_handle s) {
    alloc.move_this_thread(1);
    alloc.free(alloc.allocate(60_MiB, s));  // cached in arena 1, past the threshold's 50 MiB
    alloc.move_this_thread(0);
    void* p = alloc.allocate(20_MiB, s);  // fits beside it: only the collection frees it
    REQUIRE(all(alloc.arena(1).stats().reserved_bytes) == 0);
    REQUIRE(all(alloc.stats().reserved_bytes) <= static_cast<std::int64_t>(50_MiB));
    alloc.free(p);
    require_consistent(alloc, sim);
  });
}

TEST_CASE("device_allocator: the snapshot's segments add up to the device's reserved bytes", "[arenas]") {
  on_plain_and_vmm(80_GiB, allocator_config{}, [](sim_backend& sim, device_allocator& alloc, stream_handle s) {
    std::vector<void*> held;
    alloc.move_this_thread(1);
    for (const std::size_t n : {std::size_t{4096}, 3_MiB, 40_MiB}) held.push_back(alloc.allocate(n, s));
    alloc.move_this_thread(2);
    held.push_back(alloc.allocate(5_MiB, s));
    alloc.move_this_thread(0);
    held.push_back(alloc.allocate(2_MiB, s));
    std::int64_t total = 0;
    for (const segment_info& seg : alloc.snapshot().segments) total += static_cast<std::int64_t>(seg.total_size);
    REQUIRE(total == all(alloc.stats().reserved_bytes));
    for (void* p : held) alloc.free(p);
    require_consistent(alloc, sim);
  });
}

TEST_CASE("device_allocator: stats, snapshots, cache info and empty_cache cover every arena", "[arenas]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  std::vector<void*> held;
  for (int i = 0; i < device_allocator::k_max_arenas; ++i) {
    alloc.move_this_thread(i);
    held.push_back(alloc.allocate(3_MiB, s));
    alloc.free(alloc.allocate(25_MiB, s));
  }
  REQUIRE(alloc.arena_count() == device_allocator::k_max_arenas);
  REQUIRE(alloc.snapshot().segments.size() == 2 * held.size());
  const device_stats st = alloc.stats();
  REQUIRE(all(st.allocation) == 4);
  REQUIRE(all(st.segment) == 8);
  std::size_t largest = 0;
  std::size_t total = 0;
  alloc.cache_info(&largest, &total);
  REQUIRE(total == static_cast<std::size_t>(st.free_cached_bytes));
  REQUIRE(largest == static_cast<std::size_t>(st.largest_free_block_bytes));
  REQUIRE(total >= 4 * 25_MiB);
  require_consistent(alloc, sim);
  alloc.empty_cache();
  REQUIRE(all(alloc.stats().segment) == 4);
  for (void* p : held) alloc.free(p);
  alloc.empty_cache();
  REQUIRE(sim.used_bytes() == 0);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: a capture sends every allocation to arena 0 and defers other arenas' events",
          "[arenas]") {
  sim_backend sim(manual_events());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s1 = sim.new_stream();
  const stream_handle s2 = sim.new_stream();
  const stream_handle captured = sim.new_stream();
  alloc.move_this_thread(1);
  void* used_elsewhere = alloc.allocate(4_MiB, s1);
  alloc.record_stream(used_elsewhere, s2);
  alloc.begin_allocate_to_pool(7, [&](stream_handle st) { return st == captured; });
  void* in_pool = alloc.allocate(1_MiB, captured);
  void* plain = alloc.allocate(1_MiB, s1);
  REQUIRE(alloc.arena(0).owns(in_pool));
  REQUIRE(alloc.arena(0).owns(plain));
  const std::size_t records = sim.counters().event_records;
  alloc.free(used_elsewhere);  // arena 1's: its event waits for the capture's end
  REQUIRE(sim.counters().event_records == records);
  alloc.end_allocate_to_pool(7);
  REQUIRE(sim.counters().event_records == records + 1);
  void* after = alloc.allocate(1_MiB, s1);
  REQUIRE(alloc.arena(1).owns(after));  // back to its own arena
  sim.complete_all_events();
  alloc.free(after);
  alloc.free(in_pool);
  alloc.free(plain);
  alloc.release_pool(7);
  require_consistent(alloc, sim);
}

// A thread of another arena allocates from arena 0 while a capture is
// underway, and frees with a stream use: the free is arena 0's. Where arena
// 0's own threads allocate only inside captures, the next capture's start
// completes it (Note [arenas]).
TEST_CASE("device_allocator: a capture's start completes arena 0's finished frees", "[arenas]") {
  sim_backend sim(manual_events());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s1 = sim.new_stream();
  const stream_handle s2 = sim.new_stream();
  const stream_handle captured = sim.new_stream();
  const auto only_captured = [captured](stream_handle st) { return st == captured; };
  const auto in_capture = [&](pool_id id, auto&& body) {
    alloc.begin_allocate_to_pool(id, only_captured);
    body();
    alloc.end_allocate_to_pool(id);
    alloc.release_pool(id);
  };
  alloc.move_this_thread(1);
  void* routed = nullptr;
  in_capture(1, [&] {
    routed = alloc.allocate(4_MiB, s1);
    REQUIRE(alloc.arena(0).owns(routed));
  });
  alloc.record_stream(routed, s2);
  alloc.free(routed);  // after the capture: its event is recorded at once
  sim.complete_all_events();
  const auto pending_bytes = [&] {
    const device_stats st = alloc.arena(0).stats();
    return all(st.active_bytes) - all(st.allocated_bytes);
  };
  REQUIRE(pending_bytes() > 0);  // nothing of arena 0 ran outside a capture
  in_capture(2, [] {});
  REQUIRE(pending_bytes() == 0);
  // A capture already underway does not query events.
  void* during = nullptr;
  in_capture(3, [&] { during = alloc.allocate(4_MiB, s1); });
  alloc.record_stream(during, s2);
  alloc.free(during);
  sim.complete_all_events();
  alloc.begin_allocate_to_pool(4, only_captured);
  const std::size_t queries = sim.counters().event_queries;
  alloc.begin_allocate_to_pool(5, only_captured);
  REQUIRE(sim.counters().event_queries == queries);
  REQUIRE(pending_bytes() == 0);  // the first begin completed it
  alloc.end_allocate_to_pool(5);
  alloc.end_allocate_to_pool(4);
  alloc.release_pool(5);
  alloc.release_pool(4);
  require_consistent(alloc, sim);
}

// Graph captures come and go on arena 0 while threads on the other arenas
// (made as the captures run) allocate, free and record streams, a few
// calls inside each capture (routed to arena 0) and more between: every
// capture's blocks land in arena 0, nothing runs out of memory, and at the
// end no arena defers or holds back a finished free.
TEST_CASE("device_allocator: captures begin and end while threads allocate on other arenas", "[arenas][threads]") {
  for (const bool vmm : {false, true}) {
    CAPTURE(vmm);
    sim_backend sim(vmm ? vmm_device(8_GiB) : immediate_events(8_GiB));
    device_allocator alloc(sim, allocator_config{});
    const stream_handle captured = sim.new_stream();
    const auto only_captured = [captured](stream_handle st) { return st == captured; };
    constexpr int k_workers = 3;
    constexpr int k_calls_in_capture = 8;  // per worker and capture
    std::vector<stream_handle> streams;
    for (int i = 0; i < k_workers; ++i) streams.push_back(sim.new_stream());
    std::atomic<bool> done{false};
    std::atomic<int> phase{0};            // odd while a capture is underway
    std::atomic<std::int64_t> calls{0};   // the workers' calls so far
    std::atomic<int> ooms{0};
    std::vector<std::thread> workers;
    for (int t = 0; t < k_workers; ++t) {
      workers.emplace_back([&, t] {
        alloc.move_this_thread(1 + t);
        std::mt19937 rng(static_cast<unsigned>(77 + t));
        std::vector<void*> mine;
        int seen_phase = -1;
        int calls_in_phase = 0;
        while (!done.load()) {
          const int now = phase.load();
          if (now != seen_phase) {
            seen_phase = now;
            calls_in_phase = 0;
          }
          if (now % 2 == 1 && calls_in_phase == k_calls_in_capture) {
            std::this_thread::yield();
            continue;
          }
          ++calls_in_phase;
          if (mine.size() < 16 && (mine.empty() || rng() % 2 == 0)) {
            try {
              void* p = alloc.allocate(512 * (1 + rng() % 8192), streams[static_cast<std::size_t>(t)]);
              if (rng() % 4 == 0) alloc.record_stream(p, streams[rng() % streams.size()]);
              mine.push_back(p);
            } catch (const out_of_memory&) {
              ++ooms;
            }
          } else {
            const std::size_t i = rng() % mine.size();
            alloc.free(mine[i]);
            mine[i] = mine.back();
            mine.pop_back();
          }
          ++calls;
        }
        for (void* p : mine) alloc.free(p);
      });
    }
    const auto wait_for_calls = [&](std::int64_t until) {
      while (calls.load() < until) std::this_thread::yield();
    };
    bool all_in_arena_zero = true;
    for (pool_id id = 1; id <= 100; ++id) {
      // As a graph capture: begin takes a use of the pool, release_pool
      // gives it back.
      // The phase is odd from before the capture begins until after it
      // ends. Calls are counted from before the phase turns: the workers
      // may use up their calls in the capture before this thread looks.
      const std::int64_t before = calls.load();
      ++phase;
      alloc.begin_allocate_to_pool(id, only_captured);
      std::vector<void*> graph;
      for (int i = 0; i < 4; ++i) graph.push_back(alloc.allocate(64_KiB << i, captured));
      wait_for_calls(before + k_calls_in_capture);
      alloc.end_allocate_to_pool(id);
      ++phase;
      for (void* p : graph) {
        all_in_arena_zero = all_in_arena_zero && alloc.arena(0).owns(p);
        alloc.free(p);
      }
      alloc.release_pool(id);
      wait_for_calls(calls.load() + 64);
    }
    done = true;
    for (std::thread& th : workers) th.join();
    REQUIRE(all_in_arena_zero);
    REQUIRE(ooms.load() == 0);
    REQUIRE(alloc.arena_count() == k_workers + 1);
    // The workers' last frees of arena 0's blocks wait for a capture's start.
    alloc.begin_allocate_to_pool(1000, only_captured);
    alloc.end_allocate_to_pool(1000);
    alloc.release_pool(1000);
    for (int a = 0; a <= k_workers; ++a) {
      CAPTURE(a);
      const device_stats st = alloc.arena(a).stats();
      if (a == 0) REQUIRE(all(st.active_bytes) == all(st.allocated_bytes));
      // No capture is underway: a free with a stream use records its event
      // at once on every arena.
      alloc.move_this_thread(a);
      void* p = alloc.allocate(1_MiB, streams[0]);
      REQUIRE(alloc.arena(a).owns(p));
      alloc.record_stream(p, streams[1]);
      const std::size_t records = sim.counters().event_records;
      alloc.free(p);
      REQUIRE(sim.counters().event_records == records + 1);
    }
    require_consistent(alloc, sim);
    alloc.empty_cache();
    require_consistent(alloc, sim);
    REQUIRE(sim.used_bytes() == 0);
  }
}

TEST_CASE("device_allocator: arenas made later get the listener, fraction and settings", "[arenas]") {
  struct counting_listener final : trace_listener {
    void on_trace(const trace_event* events, std::size_t count) override {
      for (std::size_t i = 0; i < count; ++i) allocs += events[i].action == trace_action::alloc ? 1 : 0;
    }
    std::atomic<int> allocs{0};
  } listener;
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  alloc.set_trace_listener(&listener);
  alloc.set_memory_fraction(0.25);
  alloc.update_config(allocator_config::parse("max_split_size_mb:64"));
  alloc.move_this_thread(3);
  void* p = alloc.allocate(1_MiB, s);
  REQUIRE(alloc.arena(3).owns(p));
  REQUIRE(listener.allocs == 1);
  REQUIRE(alloc.arena(3).memory_fraction() == 0.25);
  REQUIRE(alloc.arena(3).config().max_split_bytes == 64_MiB);
  REQUIRE_THROWS_AS(alloc.update_config(allocator_config::parse("max_split_size_mb:64,memory_fraction:0.5")),
                    usage_error);
  REQUIRE(alloc.arena(0).config().max_split_bytes == 64_MiB);
  alloc.free(p);
  alloc.set_trace_listener(nullptr);
  require_consistent(alloc, sim);
}

// Threads on all four arenas allocate, free (a third of them another
// thread's blocks) and record streams at random; the device's counts must
// match every arena's blocks and the device's memory at the end, and the
// device's peak of allocated bytes is at least the most ever live at once.
// On a small device requests also run out of memory, through the arenas'
// ladders, which take each other's cached memory.
TEST_CASE("device_allocator: randomized threads over four arenas keep the books", "[arenas][threads]") {
  for (const auto& [vmm, capacity] : {std::pair<bool, std::size_t>{false, 8_GiB}, {true, 8_GiB}, {false, 192_MiB},
                                      {true, 192_MiB}}) {
    CAPTURE(vmm, capacity);
    sim_backend sim(vmm ? vmm_device(capacity) : immediate_events(capacity));
    device_allocator alloc(sim, allocator_config{});
    std::vector<stream_handle> streams;
    for (int i = 0; i < 4; ++i) streams.push_back(sim.new_stream());
    std::mutex handed_mutex;
    std::deque<void*> handed;  // blocks left for another thread to free
    std::atomic<std::int64_t> live{0};
    std::atomic<std::int64_t> most_live{0};
    std::atomic<int> ooms{0};
    std::vector<std::thread> threads;
    constexpr int k_threads = 8;
    for (int t = 0; t < k_threads; ++t) {
      threads.emplace_back([&, t] {
        alloc.move_this_thread(t % device_allocator::k_max_arenas);
        std::mt19937 rng(static_cast<unsigned>(1234 + t));
        std::vector<std::pair<void*, std::size_t>> mine;
        const auto release = [&](void* p, std::size_t size) {
          live -= static_cast<std::int64_t>(size);
          alloc.free(p);
        };
        for (int step = 0; step < 3000; ++step) {
          const unsigned roll = rng() % 100;
          if (roll < 50 || mine.empty()) {
            const std::size_t bytes = (rng() % 4 == 0) ? (1 + rng() % 16) * 1_MiB : 512 * (1 + rng() % 2000);
            void* p = nullptr;
            try {
              p = alloc.allocate(bytes, streams[rng() % streams.size()]);
            } catch (const out_of_memory&) {
              ++ooms;
              continue;
            }
            const std::size_t size = alloc.allocation_size(p);
            const std::int64_t now = (live += static_cast<std::int64_t>(size));
            std::int64_t seen = most_live.load();
            while (now > seen && !most_live.compare_exchange_weak(seen, now)) {
            }
            if (rng() % 10 == 0) alloc.record_stream(p, streams[rng() % streams.size()]);
            mine.emplace_back(p, size);
          } else if (roll < 65) {
            std::lock_guard<std::mutex> lock(handed_mutex);
            handed.push_back(mine.back().first);
            // The size travels with the pointer through allocation_size.
            mine.pop_back();
          } else if (roll < 80) {
            void* p = nullptr;
            {
              std::lock_guard<std::mutex> lock(handed_mutex);
              if (!handed.empty()) {
                p = handed.front();
                handed.pop_front();
              }
            }
            if (p != nullptr) release(p, alloc.allocation_size(p));
          } else {
            const std::size_t i = rng() % mine.size();
            release(mine[i].first, mine[i].second);
            mine[i] = mine.back();
            mine.pop_back();
          }
        }
        for (auto& [p, size] : mine) release(p, size);
      });
    }
    for (std::thread& th : threads) th.join();
    for (void* p : handed) alloc.free(p);
    REQUIRE(alloc.arena_count() == device_allocator::k_max_arenas);
    const device_stats st = alloc.stats();
    REQUIRE(all(st.allocated_bytes) == 0);
    REQUIRE(peak(st.allocated_bytes) >= most_live.load());
    REQUIRE(st.num_ooms == ooms.load());
    if (capacity < 1_GiB) REQUIRE(ooms.load() > 0);  // the ladders ran
    require_consistent(alloc, sim);
    alloc.empty_cache();
    require_consistent(alloc, sim);
    REQUIRE(sim.used_bytes() == 0);
  }
}

// What torch may call from any thread at any moment (memory_stats,
// snapshots, empty_cache, reset_peak_memory_stats, the memory fraction)
// while threads on four arenas allocate, with and without a collection
// threshold: every read must already hold what one arena guarantees.
// Reader-side failures are collected and asserted after the join (Catch2's
// assertions are not thread-safe).
TEST_CASE("device_allocator: stats, snapshots and empty_cache from another thread while arenas allocate",
          "[arenas][threads]") {
  for (const double threshold : {0.0, 0.5}) {
    for (const bool vmm : {false, true}) {
      CAPTURE(threshold, vmm);
      allocator_config config;
      config.garbage_collection_threshold = threshold;
      sim_backend sim(vmm ? vmm_device(256_MiB) : immediate_events(256_MiB));
      device_allocator alloc(sim, config);
      std::vector<stream_handle> streams;
      for (int i = 0; i < 4; ++i) streams.push_back(sim.new_stream());
      std::atomic<int> running{0};
      std::atomic<bool> started{false};
      // Workers go on until the reader has read this often while they ran.
      constexpr int k_reads = 200;
      std::atomic<int> reads{0};
      std::vector<std::thread> workers;
      constexpr int k_workers = 6;
      for (int t = 0; t < k_workers; ++t) {
        ++running;
        workers.emplace_back([&, t] {
          alloc.move_this_thread(t % device_allocator::k_max_arenas);
          started = true;
          std::mt19937 rng(static_cast<unsigned>(4321 + t));
          std::vector<void*> mine;
          for (int step = 0; step < 2500 || (reads.load() < k_reads && step < 1'000'000); ++step) {
            if (mine.empty() || (mine.size() < 12 && rng() % 100 < 55)) {
              const std::size_t bytes = rng() % 4 == 0 ? (1 + rng() % 12) * 1_MiB : 512 * (1 + rng() % 2000);
              try {
                void* p = alloc.allocate(bytes, streams[rng() % streams.size()]);
                if (rng() % 8 == 0) alloc.record_stream(p, streams[rng() % streams.size()]);
                mine.push_back(p);
              } catch (const out_of_memory&) {
              }
            } else {
              const std::size_t i = rng() % mine.size();
              alloc.free(mine[i]);
              mine[i] = mine.back();
              mine.pop_back();
            }
          }
          for (void* p : mine) alloc.free(p);
          --running;
        });
      }
      std::string problem;
      int during = 0;  // reads that began while every worker still ran
      while (!started.load()) std::this_thread::yield();
      while (running.load() > 0 && problem.empty()) {
        if (running.load() == k_workers) ++during;
        const int read = ++reads;
        problem = stats_read_problem(alloc.stats());
        if (problem.empty() && read % 3 == 0) {
          problem = check_snapshot_shape(alloc.snapshot(), alloc.config().min_block_bytes);
        }
        if (read % 5 == 0) {
          std::size_t largest = 0;
          std::size_t total = 0;
          alloc.cache_info(&largest, &total);
          if (largest > total) problem = "cache_info: the largest free block above the total";
        }
        if (read % 7 == 0) alloc.empty_cache();
        if (read % 11 == 0) alloc.reset_peak_stats();
        if (read % 13 == 0) alloc.set_memory_fraction(read % 2 == 0 ? 0.75 : 1.0);
      }
      for (std::thread& th : workers) th.join();
      INFO(problem);
      REQUIRE(problem.empty());
      REQUIRE(during >= k_reads);
      REQUIRE(alloc.arena_count() == device_allocator::k_max_arenas);
      REQUIRE(all(alloc.stats().allocated_bytes) == 0);
      require_consistent(alloc, sim);
      alloc.empty_cache();
      require_consistent(alloc, sim);
      REQUIRE(sim.used_bytes() == 0);
    }
  }
}

// Threads that keep finding each other in the lock: one of them moves to a
// second arena. They run until one has, for at most 60 s: on a loaded
// machine a descheduled holder stretches the gaps between contended calls
// past the 1 ms that breaks a run, so a run of 128 may take a while.
TEST_CASE("device_allocator: a thread under lasting contention moves to another arena", "[arenas][threads]") {
  sim_backend sim(immediate_events());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  std::atomic<bool> moved{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<void*> held;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!moved.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < deadline) {
        if (held.size() < 16 && rng() % 2 == 0) {
          held.push_back(alloc.allocate(512 * (1 + rng() % 4096), s));
        } else if (!held.empty()) {
          alloc.free(held.back());
          held.pop_back();
        }
        if (alloc.arena_of_this_thread() != 0) moved = true;
      }
      for (void* p : held) alloc.free(p);
    });
  }
  for (std::thread& th : threads) th.join();
  REQUIRE(moved.load());
  REQUIRE(alloc.arena_count() > 1);
  require_consistent(alloc, sim);
}

TEST_CASE("device_allocator: arenas:1 keeps one arena", "[arenas]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config::parse("arenas:1"));
  REQUIRE(alloc.max_arenas() == 1);
  REQUIRE_THROWS_AS(alloc.move_this_thread(1), usage_error);
  REQUIRE(alloc.arena_count() == 1);
  REQUIRE_THROWS_AS(allocator_config::parse("arenas:5"), config_error);
  REQUIRE_THROWS_AS(allocator_config::parse("arenas:0"), config_error);
  REQUIRE(allocator_config{}.arenas == 4);
}

// The fork handlers hold every arena's lock; in the child, whose only
// thread is the one that forked, every arena serves again.
TEST_CASE("device_allocator: a forked child allocates from every arena", "[arenas]") {
  sim_backend sim(plain_device());
  device_allocator alloc(sim, allocator_config{});
  const stream_handle s = sim.new_stream();
  alloc.move_this_thread(1);
  void* kept = alloc.allocate(1_MiB, s);
  alloc.lock_for_fork();
  const pid_t pid = fork();
  if (pid == 0) {
    alloc.unlock_after_fork();
    int failed = 0;
    try {
      for (int arena = 0; arena < 2; ++arena) {
        alloc.move_this_thread(arena);
        void* p = alloc.allocate(3_MiB, s);
        failed |= alloc.arena(arena).owns(p) ? 0 : 1;
        alloc.free(p);
      }
      alloc.validate();
    } catch (...) {
      failed = 1;
    }
    _exit(failed);
  }
  alloc.unlock_after_fork();
  REQUIRE(pid > 0);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  alloc.free(kept);
  require_consistent(alloc, sim);
}
