// stats() and snapshot() of caching_allocator: torch's key names, peaks and
// resets, and after every step of scripted sequences the stats equal an
// independent recount from the snapshot (tests/support/recount.hpp).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::find_segment;
using streamalloc::test::large_pool;
using streamalloc::test::manual_events;
using streamalloc::test::new_pending_events;
using streamalloc::test::sim_fixture;
using streamalloc::test::small_pool;

namespace {

using stat_array_list = std::array<const stat_array*, 9>;

stat_array_list stat_arrays(const device_stats& s) {
  return {&s.allocation,      &s.segment,        &s.active,       &s.inactive_split,
          &s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
          &s.requested_bytes};
}

const char* const k_array_names[9] = {"allocation",      "segment",        "active",       "inactive_split",
                                      "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                                      "requested_bytes"};
const char* const k_type_names[3] = {"all", "small_pool", "large_pool"};

// Accumulated counters must explain the current value while nothing was reset.
void check_accumulation(const device_stats& s) {
  const stat_array_list arrays = stat_arrays(s);
  for (int i = 0; i < 9; ++i) {
    for (int t = 0; t < 3; ++t) {
      const stat_counter& c = (*arrays[i])[static_cast<std::size_t>(t)];
      INFO(k_array_names[i] << "." << k_type_names[t]);
      CHECK(c.allocated - c.freed == c.current);
      CHECK(c.peak >= c.current);
    }
  }
}

}  // namespace

TEST_CASE("stats: to_map uses torch.cuda.memory_stats names and values", "[stats]") {
  sim_fixture f(manual_events());
  void* a = f.alloc.allocate(1000, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s1);
  f.alloc.free(a);
  const device_stats st = f.stats();
  const std::map<std::string, double> m = st.to_map();
  stat_array_list arrays = stat_arrays(st);
  for (int i = 0; i < 9; ++i) {
    for (int t = 0; t < 3; ++t) {
      const stat_counter& c = (*arrays[i])[static_cast<std::size_t>(t)];
      const std::string prefix = std::string(k_array_names[i]) + "." + k_type_names[t];
      for (const auto& [suffix, value] : std::vector<std::pair<const char*, std::int64_t>>{
               {".current", c.current}, {".peak", c.peak}, {".allocated", c.allocated}, {".freed", c.freed}}) {
        INFO(prefix + suffix);
        const auto it = m.find(prefix + suffix);
        REQUIRE(it != m.end());
        CHECK(it->second == static_cast<double>(value));
      }
    }
  }
  for (const char* key : {"oversize_allocations.current", "oversize_allocations.peak", "oversize_segments.current",
                          "oversize_segments.allocated", "num_alloc_retries", "num_ooms", "num_sync_all_streams",
                          "num_device_alloc", "num_device_free", "max_split_size"}) {
    INFO(key);
    CHECK(m.count(key) == 1);
  }
  CHECK(m.at("allocated_bytes.all.current") == static_cast<double>(3_MiB));
  CHECK(m.at("allocated_bytes.large_pool.current") == static_cast<double>(3_MiB));
  CHECK(m.at("allocated_bytes.small_pool.peak") == 1024.0);
  CHECK(m.at("allocated_bytes.small_pool.freed") == 1024.0);
  CHECK(m.at("reserved_bytes.all.current") == static_cast<double>(22_MiB));
  CHECK(m.at("requested_bytes.all.allocated") == static_cast<double>(1000 + 3_MiB));
  CHECK(m.at("num_device_alloc") == 2.0);
  CHECK(m.at("max_split_size") == -1.0);
  f.alloc.free(b);
}

TEST_CASE("stats: every step of a scripted sequence matches the recount", "[stats]") {
  sim_fixture f(manual_events(256_MiB));
  std::vector<void*> live;
  const auto step = [&](const char* what) {
    INFO("after: " << what);
    f.check_consistent();
    check_accumulation(f.stats());
    const device_stats st = f.stats();
    CHECK(st.num_device_alloc == static_cast<std::int64_t>(f.sim.counters().segment_allocs));
    CHECK(st.num_device_free == static_cast<std::int64_t>(f.sim.counters().segment_frees));
    std::size_t largest = 0, total = 0;
    f.alloc.cache_info(&largest, &total);
    CHECK(static_cast<std::int64_t>(largest) == st.largest_free_block_bytes);
    CHECK(static_cast<std::int64_t>(total) == st.free_cached_bytes);
  };
  step("construction");
  for (std::size_t size : {std::size_t{1}, std::size_t{700}, 4_KiB, 1_MiB, 1_MiB + 1, 9_MiB, 12_MiB, 50_MiB}) {
    live.push_back(f.alloc.allocate(size, f.s1));
    step("allocate on s1");
  }
  for (std::size_t size : {std::size_t{100}, 2_MiB, 24_MiB}) {
    live.push_back(f.alloc.allocate(size, f.s2));
    step("allocate on s2");
  }
  f.alloc.record_stream(live[2], f.s2);
  f.alloc.record_stream(live[5], f.s3);
  f.alloc.record_stream(live[9], f.s1);
  step("record_stream");
  for (std::size_t i : {2u, 5u, 9u, 0u, 6u}) {
    f.alloc.free(live[i]);
    live[i] = nullptr;
    step("free");
  }
  CHECK(all(f.stats().active) - all(f.stats().allocation) == 3);  // three pending frees
  live.push_back(f.alloc.allocate(8_MiB, f.s1));
  step("allocate with frees pending");
  f.sim.complete_stream(f.s3);
  live.push_back(f.alloc.allocate(3_KiB, f.s1));
  step("allocate after one stream completed");
  f.alloc.empty_cache();
  step("empty_cache");
  CHECK(all(f.stats().active) == all(f.stats().allocation));
  f.alloc.reset_peak_stats();
  step("reset_peak_stats");
  for (void*& p : live) {
    if (p != nullptr) f.alloc.free(p);
    p = nullptr;
    step("free all");
  }
  f.alloc.empty_cache();
  step("final empty_cache");
  CHECK(all(f.stats().reserved_bytes) == 0);
}

TEST_CASE("stats: peaks and resets", "[stats]") {
  sim_fixture f(manual_events());
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s1);
  void* c = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.free(c);
  f.alloc.free(b);
  device_stats st = f.stats();
  CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(3_MiB));
  CHECK(st.allocated_bytes[0].peak == static_cast<std::int64_t>(36_MiB));
  CHECK(st.allocation[0].peak == 3);
  CHECK(st.allocation[0].allocated == 3);
  CHECK(st.allocation[0].freed == 2);
  CHECK(st.reserved_bytes[0].peak == static_cast<std::int64_t>(50_MiB));

  f.alloc.reset_peak_stats();
  st = f.stats();
  stat_array_list arrays = stat_arrays(st);
  for (int i = 0; i < 9; ++i) {
    for (const stat_counter& c2 : *arrays[i]) {
      INFO(k_array_names[i]);
      CHECK(c2.peak == c2.current);
    }
  }
  CHECK(st.oversize_allocations.peak == st.oversize_allocations.current);
  CHECK(st.allocation[0].allocated == 3);  // accumulated counts survive a peak reset

  void* d = f.alloc.allocate(1_MiB, f.s1);
  st = f.stats();
  CHECK(st.allocated_bytes[0].peak == static_cast<std::int64_t>(4_MiB));

  REQUIRE_THROWS_AS(f.alloc.allocate(std::size_t{1} << 62, f.s1), out_of_memory);
  CHECK(f.stats().num_ooms == 1);
  f.alloc.reset_accumulated_stats();
  st = f.stats();
  arrays = stat_arrays(st);
  for (int i = 0; i < 9; ++i) {
    for (const stat_counter& c2 : *arrays[i]) {
      INFO(k_array_names[i]);
      CHECK(c2.allocated == 0);
      CHECK(c2.freed == 0);
    }
  }
  CHECK(st.num_ooms == 0);
  CHECK(st.num_alloc_retries == 0);
  CHECK(st.num_sync_all_streams == 0);
  CHECK(st.num_device_alloc == 0);
  CHECK(st.num_device_free == 0);
  CHECK(st.num_cross_stream_reuses == 0);
  CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(4_MiB));  // currents untouched
  f.check_consistent();
  f.alloc.free(a);
  f.alloc.free(d);
  st = f.stats();
  CHECK(st.allocation[0].freed == 2);
  CHECK(st.allocation[0].allocated == 0);
  f.check_consistent();
}

TEST_CASE("stats: the all entry is the pools' sum, its peak their largest sum", "[stats]") {
  // Whatever the order of small and large requests, frees and resets, each
  // family's "all" entry is the sum of its pool entries and its peak the
  // largest sum since the last reset.
  sim_fixture f(manual_events(1_GiB));
  std::mt19937_64 rng(20261203);
  std::vector<void*> live;
  // Peaks of the totals that only allocations raise, from the readings after each step.
  std::array<std::int64_t, 3> seen_peak{};
  const auto total_arrays = [](const device_stats& s) {
    return std::array<const stat_array*, 3>{&s.allocation, &s.allocated_bytes, &s.requested_bytes};
  };
  for (int i = 0; i < 3000; ++i) {
    const std::uint64_t op = rng() % 10;
    if (op < 6 || live.empty()) {
      const std::size_t bytes = std::size_t{1} << (rng() % 24);  // 1 B .. 8 MiB: both pools
      live.push_back(f.alloc.allocate(bytes + rng() % bytes, rng() % 2 == 0 ? f.s1 : f.s2));
    } else if (op < 9) {
      const std::size_t at = rng() % live.size();
      f.alloc.free(live[at]);
      live[at] = live.back();
      live.pop_back();
    } else if (rng() % 2 == 0) {
      f.alloc.reset_peak_stats();
      seen_peak = {};
    } else {
      f.alloc.reset_accumulated_stats();
    }
    if (op % 3 == 0) f.sim.complete_all_events();
    const device_stats st = f.stats();
    const stat_array_list arrays = stat_arrays(st);
    for (int a = 0; a < 9; ++a) {
      const stat_counter& total = (*arrays[a])[0];
      const stat_counter& small = (*arrays[a])[1];
      const stat_counter& large = (*arrays[a])[2];
      INFO("step " << i << ", " << k_array_names[a]);
      REQUIRE(total.current == small.current + large.current);
      REQUIRE(total.allocated == small.allocated + large.allocated);
      REQUIRE(total.freed == small.freed + large.freed);
      REQUIRE(total.peak >= total.current);
      REQUIRE(total.peak >= std::max(small.peak, large.peak));
      REQUIRE(total.peak <= small.peak + large.peak);
    }
    const auto totals = total_arrays(st);
    for (std::size_t a = 0; a < totals.size(); ++a) {
      seen_peak[a] = std::max(seen_peak[a], (*totals[a])[0].current);
      INFO("step " << i << ", array " << a);
      REQUIRE((*totals[a])[0].peak == seen_peak[a]);
    }
  }
  for (void* p : live) f.alloc.free(p);
  f.sim.complete_all_events();
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(all(f.stats().reserved_bytes) == 0);
}

TEST_CASE("stats: inactive_split counts free blocks of partly used segments", "[stats]") {
  sim_fixture f(manual_events());
  void* a = f.alloc.allocate(4_KiB, f.s1);
  // One allocated block and the free tail: the tail is an inactive split.
  device_stats st = f.stats();
  CHECK(small_pool(st.inactive_split) == 1);
  CHECK(small_pool(st.inactive_split_bytes) == static_cast<std::int64_t>(2_MiB - 4_KiB));
  void* big = f.alloc.allocate(20_MiB, f.s1);  // fills its segment: no free block
  st = f.stats();
  CHECK(large_pool(st.inactive_split) == 0);
  f.alloc.free(big);  // a whole free segment is not split
  st = f.stats();
  CHECK(large_pool(st.inactive_split) == 0);
  CHECK(st.free_cached_bytes == static_cast<std::int64_t>(20_MiB + 2_MiB - 4_KiB));
  CHECK(st.largest_free_block_bytes == static_cast<std::int64_t>(20_MiB));
  f.alloc.free(a);
  st = f.stats();
  CHECK(all(st.inactive_split) == 0);
  CHECK(all(st.inactive_split_bytes) == 0);
  CHECK(st.external_fragmentation > 0.0);
  f.check_consistent();
}

TEST_CASE("snapshot: segments, blocks and states", "[snapshot]") {
  sim_fixture f(manual_events());
  void* a = f.alloc.allocate(1000, f.s1);
  void* b = f.alloc.allocate(5000, f.s1);
  void* c = f.alloc.allocate(12_MiB, f.s2);
  f.alloc.record_stream(b, f.s3);
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(b); });
  REQUIRE(events.size() == 1);

  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 2);
  CHECK(snap.segments[0].address < snap.segments[1].address);
  const segment_info* small = find_segment(snap, addr(a));
  const segment_info* large = find_segment(snap, addr(c));
  REQUIRE(small != nullptr);
  REQUIRE(large != nullptr);
  CHECK(small->is_small);
  CHECK_FALSE(large->is_small);
  CHECK(small->stream == f.s1);
  CHECK(large->stream == f.s2);
  CHECK(small->total_size == 2_MiB);
  CHECK(large->total_size == 12_MiB);
  CHECK(small->device == 0);
  CHECK_FALSE(small->is_expandable);

  REQUIRE(small->blocks.size() == 3);
  CHECK(small->blocks[0].address == addr(a));
  CHECK(small->blocks[0].state == block_state::active_allocated);
  CHECK(small->blocks[0].size == 1024);
  CHECK(small->blocks[0].requested_size == 1000);
  CHECK(small->blocks[0].stream == f.s1);
  CHECK(small->blocks[1].address == addr(b));
  CHECK(small->blocks[1].state == block_state::active_pending_free);
  CHECK(small->blocks[1].size == 5120);
  CHECK(small->blocks[2].state == block_state::inactive);
  CHECK(small->blocks[2].size == 2_MiB - 1024 - 5120);
  CHECK(small->blocks[2].requested_size == 0);
  CHECK(small->allocated_size == 1024);
  CHECK(small->active_size == 1024 + 5120);

  REQUIRE(large->blocks.size() == 1);
  CHECK(large->blocks[0].state == block_state::active_allocated);
  CHECK(large->blocks[0].requested_size == 12_MiB);
  CHECK(large->allocated_size == 12_MiB);
  CHECK(large->requested_size == 12_MiB);

  CHECK(std::string(to_string(block_state::active_allocated)) == "active_allocated");
  CHECK(std::string(to_string(block_state::active_pending_free)) == "active_pending_free");
  CHECK(std::string(to_string(block_state::inactive)) == "inactive");
  f.check_consistent();

  f.sim.complete_event(events[0]);
  f.alloc.free(a);
  f.alloc.empty_cache();
  const allocator_snapshot after = f.snapshot();
  REQUIRE(after.segments.size() == 1);
  CHECK(after.segments[0].address == large->address);
  f.check_consistent();
  f.alloc.free(c);
}

TEST_CASE("snapshot: private pool segments carry their pool id", "[snapshot]") {
  sim_fixture f(manual_events());
  f.alloc.begin_allocate_to_pool(3, [](stream_handle) { return true; });
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* q = f.alloc.allocate(40_MiB, f.s2);
  f.alloc.end_allocate_to_pool(3);
  void* r = f.alloc.allocate(4_KiB, f.s1);
  const allocator_snapshot snap = f.snapshot();
  for (void* ptr : {p, q}) {
    const segment_info* seg = find_segment(snap, addr(ptr));
    REQUIRE(seg != nullptr);
    CHECK(seg->pool == 3);
  }
  const segment_info* seg = find_segment(snap, addr(r));
  REQUIRE(seg != nullptr);
  CHECK(seg->pool == 0);
  f.check_consistent();
  for (void* ptr : {p, q, r}) f.alloc.free(ptr);
  f.alloc.release_pool(3);
  // Note [released pools]: kept until the cache is emptied, as in torch.
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(2_MiB + 2_MiB + 40_MiB));
  f.alloc.empty_cache(3);
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(2_MiB));
  f.check_consistent();
}
