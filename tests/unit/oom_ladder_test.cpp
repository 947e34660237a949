// The OOM ladder of caching_allocator, one stage at a time: free list,
// reclaimed pending frees, cross-stream hand-off, growth, release of
// oversize blocks, full release after synchronizing, and out_of_memory.
// Also memory_fraction and empty_cache, which bound and undo growth.
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::all;
using streamalloc::test::manual_events;
using streamalloc::test::new_pending_events;
using streamalloc::test::sim_fixture;

namespace {

allocator_config config_with(bool cross_stream, std::size_t max_split_bytes = static_cast<std::size_t>(-1)) {
  allocator_config c;
  c.cross_stream_reuse = cross_stream;
  c.max_split_bytes = max_split_bytes;
  return c;
}

std::int64_t mib(std::size_t n) { return static_cast<std::int64_t>(n << 20); }

using streamalloc::test::contains;

}  // namespace

TEST_CASE("oom ladder: stage 1, a cached block is reused without touching the device", "[oom_ladder]") {
  sim_fixture f(manual_events(64_MiB));
  void* p = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.free(p);
  const sim_counters before = f.sim.counters();
  void* q = f.alloc.allocate(30_MiB, f.s1);
  CHECK(q == p);
  CHECK(f.sim.counters().segment_allocs == before.segment_allocs);
  CHECK(f.sim.counters().event_records == before.event_records);
  CHECK(f.stats().num_alloc_retries == 0);
  f.check_consistent();
  f.alloc.free(q);
}

TEST_CASE("oom ladder: stage 2, a completed pending free is reclaimed before anything else", "[oom_ladder]") {
  sim_fixture f(manual_events(64_MiB));
  // A free block of the right size cached for another stream must lose
  // against the reclaimed block of the requesting stream.
  void* p = f.alloc.allocate(20_MiB, f.s1);
  void* other = f.alloc.allocate(20_MiB, f.s2);
  f.alloc.free(other);
  f.alloc.record_stream(p, f.s3);
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(p); });
  REQUIRE(events.size() == 1);
  f.sim.complete_event(events[0]);
  const sim_counters before = f.sim.counters();
  void* q = f.alloc.allocate(20_MiB, f.s1);
  CHECK(q == p);
  CHECK(f.stats().num_cross_stream_reuses == 0);
  CHECK(f.sim.counters().segment_allocs == before.segment_allocs);
  CHECK(f.stats().num_alloc_retries == 0);
  CHECK(f.stats().num_sync_all_streams == 0);
  f.check_consistent();
  f.alloc.free(q);
}

TEST_CASE("oom ladder: stage 3, another stream's free block comes before growing", "[oom_ladder]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(20_MiB, f.s1);
  f.alloc.free(p);
  const sim_counters before = f.sim.counters();
  void* q = f.alloc.allocate(20_MiB, f.s2);
  CHECK(q == p);
  CHECK(f.sim.counters().segment_allocs == before.segment_allocs);
  CHECK(f.sim.counters().stream_waits == before.stream_waits + 1);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  CHECK(f.stats().num_alloc_retries == 0);
  f.check_consistent();
  f.alloc.free(q);
  f.sim.complete_all_events();
}

TEST_CASE("oom ladder: stage 4, growth adds one segment", "[oom_ladder]") {
  sim_fixture f(manual_events(64_MiB));
  void* p = f.alloc.allocate(30_MiB, f.s1);
  void* q = f.alloc.allocate(30_MiB, f.s1);
  CHECK(f.sim.counters().segment_allocs == 2);
  CHECK(f.stats().num_device_alloc == 2);
  CHECK(f.stats().num_alloc_retries == 0);
  CHECK(f.sim.is_device_memory(q, 30_MiB));
  CHECK(all(f.stats().reserved_bytes) == mib(60));
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(q);
}

TEST_CASE("oom ladder: stage 5, cached oversize blocks are released and growth retried", "[oom_ladder]") {
  sim_fixture f(manual_events(80_MiB), config_with(true, 40_MiB));
  void* big = f.alloc.allocate(60_MiB, f.s1);
  void* small = f.alloc.allocate(1000, f.s1);
  f.alloc.free(big);
  f.alloc.free(small);
  REQUIRE(all(f.stats().reserved_bytes) == mib(62));
  const sim_counters before = f.sim.counters();
  // 30 MiB may not take the oversize block, and 62 + 30 MiB do not fit.
  void* p = f.alloc.allocate(30_MiB, f.s1);
  REQUIRE(p != nullptr);
  const device_stats st = f.stats();
  CHECK(st.num_alloc_retries == 1);
  CHECK(st.num_sync_all_streams == 0);  // stage 6 was not needed
  CHECK(st.num_ooms == 0);
  CHECK(st.oversize_segments.current == 0);
  CHECK(f.sim.counters().segment_frees == before.segment_frees + 1);
  CHECK(f.sim.live_segments() == 2);  // the cached small segment survives
  CHECK(all(st.reserved_bytes) == mib(32));
  CHECK(f.sim.is_device_memory(p, 30_MiB));
  CHECK_FALSE(f.sim.is_device_memory(big, 1));
  f.check_consistent();
  f.alloc.free(p);
}

TEST_CASE("oom ladder: stage 6, pending frees are synchronized and unused segments released", "[oom_ladder]") {
  sim_fixture f(manual_events(64_MiB));
  void* pend = f.alloc.allocate(10_MiB, f.s1);
  void* keep = f.alloc.allocate(12_MiB, f.s1);
  void* a = f.alloc.allocate(9_MiB, f.s1);  // 20 MiB segment, 11 MiB of it free
  void* b = f.alloc.allocate(1000, f.s1);   // 2 MiB segment
  f.alloc.free(a);
  f.alloc.free(b);
  f.alloc.record_stream(pend, f.s3);
  f.alloc.free(pend);
  REQUIRE(f.sim.pending_events().size() == 1);
  REQUIRE(all(f.stats().reserved_bytes) == mib(44));
  const sim_counters before = f.sim.counters();

  void* p = f.alloc.allocate(30_MiB, f.s1);
  REQUIRE(p != nullptr);
  const device_stats st = f.stats();
  CHECK(st.num_alloc_retries == 1);
  CHECK(st.num_sync_all_streams == 1);
  CHECK(st.num_ooms == 0);
  CHECK(f.sim.pending_events().empty());
  const sim_counters after = f.sim.counters();
  CHECK(after.event_syncs + after.device_syncs > before.event_syncs + before.device_syncs);
  CHECK(after.segment_frees == before.segment_frees + 3);
  CHECK(all(st.reserved_bytes) == mib(42));
  CHECK(f.sim.live_segments() == 2);
  CHECK(f.alloc.owns(keep));
  CHECK(f.sim.is_device_memory(keep, 12_MiB));
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(keep);
}

TEST_CASE("oom ladder: stage 6, a synchronized pending free serves the request before any release", "[oom_ladder]") {
  sim_fixture f(manual_events(40_MiB));
  void* keep = f.alloc.allocate(10_MiB, f.s1);
  void* pend = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.record_stream(pend, f.s2);
  f.alloc.free(pend);
  const sim_counters before = f.sim.counters();
  void* p = f.alloc.allocate(30_MiB, f.s1);
  CHECK(p == pend);
  CHECK(f.sim.counters().segment_frees == before.segment_frees);
  CHECK(f.stats().num_sync_all_streams == 1);
  CHECK(f.stats().num_alloc_retries == 1);
  CHECK(f.sim.pending_events().empty());
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(keep);
}

TEST_CASE("oom ladder: stage 7, out_of_memory with context, and the allocator survives", "[oom_ladder]") {
  sim_fixture f(manual_events(64_MiB));
  void* x = f.alloc.allocate(9_MiB, f.s1);  // leaves an 11 MiB free block in its segment
  void* y = f.alloc.allocate(40_MiB, f.s1);
  const auto before = f.stats().to_map();

  bool thrown = false;
  try {
    f.alloc.allocate(30_MiB, f.s1);
  } catch (const out_of_memory& e) {
    thrown = true;
    const oom_context& c = e.context();
    CHECK(c.requested_bytes == 30_MiB);
    CHECK(c.device_total_bytes == 64_MiB);
    CHECK(c.device_free_bytes == 4_MiB);
    CHECK(c.allocated_bytes == 49_MiB);
    CHECK(c.reserved_bytes == 60_MiB);
    CHECK(c.largest_free_block_bytes == 11_MiB);
    CHECK(c.allowed_bytes == 64_MiB);
    CHECK(c.device == 0);
    const std::string message = e.what();
    INFO(message);
    CHECK(contains(message, format_bytes(30_MiB)));
    CHECK(contains(message, format_bytes(64_MiB)));
    CHECK(contains(message, format_bytes(49_MiB)));
    CHECK(contains(message, format_bytes(60_MiB)));
  }
  CHECK(thrown);
  REQUIRE_THROWS_AS(f.alloc.allocate(30_MiB, f.s2), std::bad_alloc);

  auto after = f.stats().to_map();
  CHECK(after["num_ooms"] == 2);
  CHECK(after["num_alloc_retries"] == 2);
  // Nothing else moved: the failed requests left no trace.
  for (const char* counter : {"num_ooms", "num_alloc_retries", "num_sync_all_streams"}) {
    after.erase(counter);
  }
  auto expected = before;
  for (const char* counter : {"num_ooms", "num_alloc_retries", "num_sync_all_streams"}) {
    expected.erase(counter);
  }
  CHECK(after == expected);
  f.check_consistent();

  // The memory is usable again once something is freed.
  f.alloc.free(y);
  void* p = f.alloc.allocate(30_MiB, f.s1);
  CHECK(p == y);
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(x);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
}

TEST_CASE("oom ladder: injected segment failures", "[oom_ladder]") {
  sim_fixture f(manual_events());
  SECTION("one failed growth is retried after releasing the cache") {
    void* cached = f.alloc.allocate(1000, f.s1);
    f.alloc.free(cached);
    f.sim.fail_nth(sim_fault_point::allocate_segment, 1);
    void* p = f.alloc.allocate(30_MiB, f.s1);
    REQUIRE(p != nullptr);
    CHECK(f.sim.is_device_memory(p, 30_MiB));
    CHECK(f.stats().num_alloc_retries == 1);
    CHECK(f.stats().num_ooms == 0);
    CHECK(f.sim.live_segments() == 1);  // stage 6 released the cached small segment
    f.check_consistent();
    f.alloc.free(p);
  }
  SECTION("a device that always fails gives out_of_memory until it recovers") {
    void* keep = f.alloc.allocate(1000, f.s1);
    f.sim.fail_always(sim_fault_point::allocate_segment);
    try {
      f.alloc.allocate(30_MiB, f.s1);
      FAIL("allocate returned while every segment allocation fails");
    } catch (const out_of_memory& e) {
      CHECK(e.context().requested_bytes == 30_MiB);
      CHECK(e.context().reserved_bytes == 2_MiB);
      CHECK(e.context().device_free_bytes == 80_GiB - 2_MiB);
    }
    // A request the cache can serve needs no device memory.
    void* small = f.alloc.allocate(4096, f.s1);
    CHECK(small != nullptr);
    CHECK(f.stats().num_ooms == 1);
    f.check_consistent();
    f.sim.clear_faults();
    void* p = f.alloc.allocate(30_MiB, f.s1);
    CHECK(p != nullptr);
    f.check_consistent();
    for (void* q : {keep, small, p}) f.alloc.free(q);
  }
}

TEST_CASE("oom ladder: memory_fraction caps reserved memory", "[oom_ladder]") {
  sim_fixture f(manual_events(100_MiB), config_with(false));
  CHECK(f.alloc.memory_fraction() == 1.0);
  f.alloc.set_memory_fraction(0.5);
  CHECK(f.alloc.memory_fraction() == 0.5);
  void* a = f.alloc.allocate(40_MiB, f.s1);
  try {
    f.alloc.allocate(12_MiB, f.s1);
    FAIL("52 MiB reserved under a 50 MiB cap");
  } catch (const out_of_memory& e) {
    CHECK(e.context().allowed_bytes == 50_MiB);
    CHECK(e.context().device_free_bytes == 60_MiB);
    CHECK(e.context().reserved_bytes == 40_MiB);
    CHECK(contains(e.what(), format_bytes(50_MiB)));
  }
  CHECK(f.sim.used_bytes() == 40_MiB);
  void* b = f.alloc.allocate(10_MiB, f.s1);  // exactly at the cap
  CHECK(all(f.stats().reserved_bytes) == mib(50));
  f.check_consistent();

  SECTION("raising the fraction lifts the cap") {
    f.alloc.set_memory_fraction(1.0);
    void* c = f.alloc.allocate(12_MiB, f.s1);
    CHECK(c != nullptr);
    f.alloc.free(c);
  }
  SECTION("cached memory over the cap is released to make room") {
    f.alloc.free(a);  // cached for s1; s2 cannot borrow it (cross-stream reuse off)
    const std::int64_t retries = f.stats().num_alloc_retries;
    void* c = f.alloc.allocate(30_MiB, f.s2);
    CHECK(c != nullptr);
    CHECK(f.stats().num_alloc_retries == retries + 1);
    CHECK(f.stats().num_ooms == 1);
    CHECK(all(f.stats().reserved_bytes) == mib(40));
    f.check_consistent();
    f.alloc.free(c);
    a = nullptr;
  }
  if (a != nullptr) f.alloc.free(a);
  f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("oom ladder: memory_fraction from the config", "[oom_ladder]") {
  allocator_config cfg;
  cfg.memory_fraction = 0.25;
  sim_fixture f(manual_events(100_MiB), cfg);
  CHECK(f.alloc.memory_fraction() == 0.25);
  REQUIRE_THROWS_AS(f.alloc.allocate(26_MiB, f.s1), out_of_memory);
  void* p = f.alloc.allocate(24_MiB, f.s1);
  CHECK(p != nullptr);
  f.check_consistent();
  f.alloc.free(p);
}

TEST_CASE("oom ladder: memory_fraction 0 lets the cache serve and nothing grow, as in torch", "[oom_ladder]") {
  sim_fixture f(manual_events(100_MiB), config_with(false));
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* big = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.free(big);
  f.alloc.set_memory_fraction(0.0);
  CHECK(f.alloc.memory_fraction() == 0.0);
  const std::size_t segment_allocs = f.sim.counters().segment_allocs;

  // Cached blocks still serve...
  void* b = f.alloc.allocate(4_KiB, f.s1);
  void* c = f.alloc.allocate(30_MiB, f.s1);
  CHECK(c == big);
  // ...but every request that needs a new segment fails, small or large.
  for (std::size_t bytes : {std::size_t{1}, std::size_t{2_MiB}, std::size_t{30_MiB}}) {
    CAPTURE(bytes);
    try {
      f.alloc.allocate(bytes, f.s2);
      FAIL("grew under a memory fraction of 0");
    } catch (const out_of_memory& e) {
      CHECK(e.context().allowed_bytes == 0);
    }
  }
  CHECK(f.sim.counters().segment_allocs == segment_allocs);
  f.check_consistent();

  SECTION("empty_cache still returns memory") {
    f.alloc.free(c);
    f.alloc.empty_cache();
    CHECK(all(f.stats().reserved_bytes) == mib(2));
    REQUIRE_THROWS_AS(f.alloc.allocate(30_MiB, f.s1), out_of_memory);
    c = nullptr;
  }
  SECTION("a fraction above 0 lets it grow again") {
    f.alloc.set_memory_fraction(0.5);
    void* d = f.alloc.allocate(4_KiB, f.s2);
    CHECK(d != nullptr);
    f.alloc.free(d);
  }
  for (void* p : {a, b, c}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("oom ladder: empty_cache returns every unused segment", "[oom_ladder]") {
  sim_fixture f(manual_events(), config_with(false));  // one segment per stream below
  void* keep_small = f.alloc.allocate(1000, f.s1);
  void* free_small = f.alloc.allocate(1_MiB, f.s2);  // its own small segment
  void* keep_large = f.alloc.allocate(9_MiB, f.s1);
  void* free_large = f.alloc.allocate(9_MiB, f.s2);
  void* free_huge = f.alloc.allocate(30_MiB, f.s3);
  void* spare = f.alloc.allocate(4096, f.s1);
  for (void* p : {free_small, free_large, free_huge, spare}) f.alloc.free(p);
  REQUIRE(f.sim.live_segments() == 5);
  const std::int64_t frees = f.stats().num_device_free;

  f.alloc.empty_cache();
  const allocator_snapshot snap = f.snapshot();
  CHECK(snap.segments.size() == 2);
  std::int64_t holding_live = 0;
  for (const segment_info& seg : snap.segments) {
    CHECK(seg.allocated_size > 0);
    holding_live += static_cast<std::int64_t>(seg.total_size);
  }
  CHECK(all(f.stats().reserved_bytes) == holding_live);
  CHECK(holding_live == mib(22));
  CHECK(f.sim.used_bytes() == 22_MiB);
  CHECK(f.stats().num_device_free == frees + 3);
  CHECK(f.alloc.owns(keep_small));
  CHECK(f.alloc.owns(keep_large));
  f.check_consistent();

  f.alloc.free(keep_small);
  f.alloc.free(keep_large);
  f.alloc.empty_cache();
  CHECK(all(f.stats().reserved_bytes) == 0);
  CHECK(f.sim.used_bytes() == 0);
  CHECK(f.sim.live_segments() == 0);
  f.check_consistent();
}
