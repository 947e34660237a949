// Stream-safety tests of caching_allocator: a block used on other streams
// (record_stream) stays pending after free until every event recorded for
// it completes, whatever the completion order, and Note [cross-stream
// reuse] hands free blocks between streams only through a stream wait.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::count_state;
using streamalloc::test::find_block;
using streamalloc::test::find_segment;
using streamalloc::test::manual_events;
using streamalloc::test::new_pending_events;
using streamalloc::test::sim_fixture;

namespace {

bool overlaps(std::uintptr_t a, std::size_t a_size, std::uintptr_t b, std::size_t b_size) {
  return a < b + b_size && b < a + a_size;
}

block_state state_at(const sim_fixture& f, const void* p) {
  const allocator_snapshot snap = f.snapshot();
  const block_info* b = find_block(snap, addr(p));
  REQUIRE(b != nullptr);
  return b->state;
}

allocator_config no_cross_stream() {
  allocator_config c;
  c.cross_stream_reuse = false;
  return c;
}

}  // namespace

TEST_CASE("stream safety: a freed block used on other streams stays pending", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.alloc.record_stream(p, f.s3);
  f.alloc.record_stream(p, f.s2);  // a repeated use adds nothing
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(p); });
  REQUIRE(events.size() == 2);
  CHECK(state_at(f, p) == block_state::active_pending_free);
  {
    const device_stats st = f.stats();
    CHECK(all(st.allocation) == 0);
    CHECK(all(st.allocated_bytes) == 0);
    CHECK(all(st.requested_bytes) == 0);
    CHECK(all(st.active) == 1);
    CHECK(all(st.active_bytes) == static_cast<std::int64_t>(4_KiB));
  }
  f.check_consistent();

  // Requests of every size class on every stream avoid the pending block.
  std::vector<void*> probes;
  const auto probe_all_streams = [&] {
    for (stream_handle s : {f.s1, f.s2, f.s3}) {
      for (std::size_t size : {std::size_t{512}, 4_KiB, std::size_t{3000}}) {
        void* q = f.alloc.allocate(size, s);
        CHECK_FALSE(overlaps(addr(q), f.alloc.allocation_size(q), addr(p), 4_KiB));
        probes.push_back(q);
      }
    }
    f.check_consistent();
  };
  probe_all_streams();

  SECTION("completed in record order") {
    f.sim.complete_event(events[0]);
    probe_all_streams();
    CHECK(state_at(f, p) == block_state::active_pending_free);
    f.sim.complete_event(events[1]);
  }
  SECTION("completed in reverse order") {
    f.sim.complete_event(events[1]);
    probe_all_streams();
    CHECK(state_at(f, p) == block_state::active_pending_free);
    f.sim.complete_event(events[0]);
  }
  SECTION("completed by stream") {
    f.sim.complete_stream(f.s3);
    probe_all_streams();
    CHECK(state_at(f, p) == block_state::active_pending_free);
    f.sim.complete_stream(f.s2);
  }
  // Once every event is done the block goes back to its pool.
  for (void* q : probes) f.alloc.free(q);
  f.alloc.empty_cache();
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 0);
  CHECK(all(f.stats().active) == 0);
  CHECK(all(f.stats().reserved_bytes) == 0);
  f.check_consistent();
}

TEST_CASE("stream safety: completed pending frees are reclaimed at the start of the next allocation",
          "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* guard = f.alloc.allocate(4_KiB, f.s1);  // p's right neighbour stays live
  f.alloc.record_stream(p, f.s2);
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(p); });
  REQUIRE(events.size() == 1);
  f.sim.complete_event(events[0]);
  const std::size_t queries = f.sim.counters().event_queries;
  // The segment's tail could serve this request, but p's block is now the
  // best fit: it must have been reclaimed before the search.
  void* q = f.alloc.allocate(4_KiB, f.s1);
  CHECK(f.sim.counters().event_queries > queries);
  CHECK(q == p);
  CHECK(all(f.stats().active) == 2);
  f.check_consistent();
  f.alloc.free(q);
  f.alloc.free(guard);
}

TEST_CASE("stream safety: adversarial completion orders interleaved with allocations", "[stream_safety]") {
  for (unsigned seed = 1; seed <= 40; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    sim_fixture f(manual_events());
    std::vector<stream_handle> streams = {f.s1, f.s2, f.s3, f.sim.new_stream(), f.sim.new_stream()};
    const std::size_t size = (seed % 2 == 0) ? 4_KiB : 3_MiB;  // small and large pool
    void* p = f.alloc.allocate(size, f.s1);
    const std::size_t p_size = f.alloc.allocation_size(p);
    for (std::size_t i = 1; i < streams.size(); ++i) f.alloc.record_stream(p, streams[i]);
    std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(p); });
    REQUIRE(events.size() == streams.size() - 1);
    switch (seed % 3) {
      case 0:
        break;  // record order
      case 1:
        std::reverse(events.begin(), events.end());
        break;
      default:
        std::shuffle(events.begin(), events.end(), rng);
        break;
    }

    std::vector<void*> live;
    const auto churn = [&](bool p_pending) {
      for (int i = 0; i < 12; ++i) {
        if (!live.empty() && rng() % 3 == 0) {
          const std::size_t k = rng() % live.size();
          f.alloc.free(live[k]);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
          continue;
        }
        const stream_handle s = streams[rng() % streams.size()];
        const std::size_t request = rng() % 4 == 0 ? size : 1 + rng() % (2 * size);
        void* q = f.alloc.allocate(request, s);
        if (p_pending) {
          INFO("request " << request << " on stream " << s);
          REQUIRE_FALSE(overlaps(addr(q), f.alloc.allocation_size(q), addr(p), p_size));
        }
        live.push_back(q);
      }
      f.check_consistent();
    };
    churn(true);
    for (std::size_t i = 0; i < events.size(); ++i) {
      f.sim.complete_event(events[i]);
      const bool still_pending = i + 1 < events.size();
      churn(still_pending);
      if (still_pending) CHECK(state_at(f, p) == block_state::active_pending_free);
    }
    for (void* q : live) f.alloc.free(q);
    f.alloc.empty_cache();
    CHECK(all(f.stats().reserved_bytes) == 0);
    CHECK(f.sim.used_bytes() == 0);
    f.check_consistent();
  }
}

TEST_CASE("stream safety: pending frees on one stream, completed out of record order", "[stream_safety]") {
  // The sim lets a later record on a stream complete before an earlier one
  // (a real device cannot); the allocator may be slow to notice, but must
  // never hand out a block whose own event is still pending.
  sim_fixture f(manual_events());
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* b = f.alloc.allocate(4_KiB, f.s1);
  void* guard = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.record_stream(a, f.s2);
  f.alloc.record_stream(b, f.s2);
  const std::vector<event_handle> ea = new_pending_events(f.sim, [&] { f.alloc.free(a); });
  const std::vector<event_handle> eb = new_pending_events(f.sim, [&] { f.alloc.free(b); });
  REQUIRE(ea.size() == 1);
  REQUIRE(eb.size() == 1);
  f.sim.complete_event(eb[0]);
  std::vector<void*> live;
  for (int i = 0; i < 8; ++i) {
    void* q = f.alloc.allocate(4_KiB, i % 2 == 0 ? f.s1 : f.s2);
    CHECK_FALSE(overlaps(addr(q), f.alloc.allocation_size(q), addr(a), 4_KiB));
    live.push_back(q);
  }
  CHECK(state_at(f, a) == block_state::active_pending_free);
  f.check_consistent();
  for (void* q : live) f.alloc.free(q);
  f.alloc.free(guard);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

TEST_CASE("stream safety: cross-stream reuse hands a free block over through a stream wait", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(1000, f.s1);
  f.alloc.free(p);  // cached for s1; no stream uses, so free at once
  REQUIRE(state_at(f, p) == block_state::inactive);
  const sim_counters before = f.sim.counters();

  void* q = nullptr;
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { q = f.alloc.allocate(1000, f.s2); });
  CHECK(q == p);
  REQUIRE(events.size() == 1);
  CHECK(f.sim.stream_waited_on(f.s2, events[0]));
  CHECK_FALSE(f.sim.stream_waited_on(f.s1, events[0]));
  const sim_counters after = f.sim.counters();
  CHECK(after.segment_allocs == before.segment_allocs);
  CHECK(after.stream_waits == before.stream_waits + 1);
  CHECK(after.event_syncs == before.event_syncs);
  CHECK(after.device_syncs == before.device_syncs);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  {
    const allocator_snapshot snap = f.snapshot();
    const block_info* b = find_block(snap, addr(q));
    REQUIRE(b != nullptr);
    CHECK(b->stream == f.s2);  // the allocating stream is the block's stream
    CHECK(b->state == block_state::active_allocated);
  }
  f.check_consistent();

  SECTION("a stream with a fitting block of its own does not borrow") {
    f.alloc.free(q);
    void* r = f.alloc.allocate(1000, f.s2);
    CHECK(r == q);
    CHECK(f.stats().num_cross_stream_reuses == 1);
    CHECK(f.sim.counters().stream_waits == before.stream_waits + 1);
    f.alloc.free(r);
  }
  SECTION("the rest of the borrowed block is the borrower's (Note [borrowed remainders])") {
    void* r = f.alloc.allocate(1000, f.s2);
    CHECK(addr(r) == addr(q) + 1024);
    CHECK(f.stats().num_cross_stream_reuses == 1);
    CHECK(f.sim.counters().stream_waits == before.stream_waits + 1);
    // The lender has nothing of its own left: its next request is a
    // hand-off back, ordered by a second wait.
    void* back = f.alloc.allocate(1000, f.s1);
    CHECK_FALSE(overlaps(addr(back), f.alloc.allocation_size(back), addr(q), 2048));
    CHECK(f.stats().num_cross_stream_reuses == 2);
    CHECK(f.sim.counters().stream_waits == before.stream_waits + 2);
    for (void* x : {back, r, q}) f.alloc.free(x);
  }
  f.check_consistent();
  f.sim.complete_all_events();
}

TEST_CASE("stream safety: pending blocks are never handed to another stream", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(20_MiB, f.s1);  // a whole 20 MiB segment
  f.alloc.record_stream(p, f.s3);
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { f.alloc.free(p); });
  REQUIRE(events.size() == 1);
  const std::size_t segments = f.sim.counters().segment_allocs;
  void* q = f.alloc.allocate(20_MiB, f.s2);
  CHECK(q != p);
  CHECK(f.sim.counters().segment_allocs == segments + 1);
  CHECK(f.stats().num_cross_stream_reuses == 0);
  CHECK(state_at(f, p) == block_state::active_pending_free);
  f.check_consistent();
  f.alloc.free(q);
  f.sim.complete_all_events();
}

TEST_CASE("stream safety: without cross_stream_reuse another stream grows instead", "[stream_safety]") {
  sim_fixture f(manual_events(), no_cross_stream());
  void* p = f.alloc.allocate(1000, f.s1);
  f.alloc.free(p);
  const sim_counters before = f.sim.counters();
  void* q = nullptr;
  const std::vector<event_handle> events = new_pending_events(f.sim, [&] { q = f.alloc.allocate(1000, f.s2); });
  CHECK(events.empty());
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  CHECK_FALSE(overlaps(addr(q), 1024, seg->address, seg->total_size));
  const sim_counters after = f.sim.counters();
  CHECK(after.segment_allocs == before.segment_allocs + 1);
  CHECK(after.stream_waits == before.stream_waits);
  CHECK(after.event_records == before.event_records);
  CHECK(f.stats().num_cross_stream_reuses == 0);
  f.check_consistent();
  f.alloc.free(q);
}

TEST_CASE("stream safety: with immediate events a pending free is reusable after the next poll", "[stream_safety]") {
  sim_fixture f(streamalloc::test::immediate_events(), no_cross_stream());
  void* p = f.alloc.allocate(20_MiB, f.s1);  // fills its segment: nothing else can serve
  f.alloc.record_stream(p, f.s2);
  f.alloc.free(p);
  CHECK(f.sim.pending_events().empty());
  void* q = f.alloc.allocate(20_MiB, f.s1);
  CHECK(q == p);
  CHECK(f.sim.counters().segment_allocs == 1);
  f.check_consistent();
  f.alloc.free(q);
}

TEST_CASE("stream safety: empty_cache waits for pending frees before releasing", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* keep = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.alloc.free(p);
  REQUIRE(f.sim.pending_events().size() == 1);
  const sim_counters before = f.sim.counters();
  f.alloc.empty_cache();
  const sim_counters after = f.sim.counters();
  CHECK(after.event_syncs + after.device_syncs > before.event_syncs + before.device_syncs);
  CHECK(f.sim.pending_events().empty());
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 0);
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(30_MiB));
  CHECK(f.sim.used_bytes() == 30_MiB);
  f.check_consistent();
  f.alloc.free(keep);
}

TEST_CASE("stream safety: a free during a capture stays pending until its events complete", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(20_MiB, f.s1);  // a whole segment of the default pool
  f.alloc.record_stream(p, f.s2);
  f.alloc.begin_allocate_to_pool(5, [&](stream_handle s) { return s == f.s3; });
  f.alloc.free(p);
  CHECK(state_at(f, p) == block_state::active_pending_free);
  void* q = f.alloc.allocate(20_MiB, f.s1);  // s1 is not captured: default pool
  CHECK(q != p);
  f.check_consistent();
  f.alloc.end_allocate_to_pool(5);

  // The stream use still has to finish after the capture ends.
  CHECK(state_at(f, p) == block_state::active_pending_free);
  void* r = f.alloc.allocate(20_MiB, f.s1);
  CHECK(r != p);
  f.check_consistent();
  f.sim.complete_stream(f.s2);
  void* t = f.alloc.allocate(20_MiB, f.s1);
  CHECK(t == p);
  f.check_consistent();
  for (void* x : {q, r, t}) f.alloc.free(x);
  f.alloc.release_pool(5);
  f.check_consistent();
}

TEST_CASE("stream safety: a handed-off block and its remainder stay with the new stream", "[stream_safety]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(1000, f.s1);
  f.alloc.free(p);
  void* q = f.alloc.allocate(1000, f.s2);  // borrowed from s1's free segment
  REQUIRE(q == p);
  REQUIRE(f.stats().num_cross_stream_reuses == 1);
  // Note [borrowed remainders]: the rest of the segment went to s2 with q,
  // so freeing q merges the segment back into one block of s2.
  const allocator_snapshot held = f.snapshot();
  REQUIRE(held.segments.size() == 1);
  REQUIRE(held.segments[0].blocks.size() == 2);
  CHECK(held.segments[0].blocks[1].stream == f.s2);
  f.alloc.free(q);
  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  REQUIRE(snap.segments[0].blocks.size() == 1);
  CHECK(snap.segments[0].blocks[0].stream == f.s2);
  CHECK(snap.segments[0].blocks[0].state == block_state::inactive);
  f.check_consistent();
  // s2 reuses it without another hand-off; s1 must borrow it back.
  void* a = f.alloc.allocate(1000, f.s2);
  CHECK(a == q);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  void* b = f.alloc.allocate(1000, f.s1);
  CHECK(addr(b) == addr(p) + 1024);
  CHECK(f.stats().num_cross_stream_reuses == 2);
  f.check_consistent();
  f.alloc.free(a);
  f.alloc.free(b);
  // A fully free segment is released even though its blocks differ in stream.
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
  f.sim.complete_all_events();
}

TEST_CASE("stream safety: cross-stream reuse respects the oversize rules", "[stream_safety]") {
  allocator_config cfg;
  cfg.max_split_bytes = 40_MiB;
  sim_fixture f(manual_events(), cfg);
  void* big = f.alloc.allocate(80_MiB, f.s1);
  f.alloc.free(big);
  void* p = f.alloc.allocate(30_MiB, f.s2);  // below max_split: may not take the oversize block
  CHECK(p != big);
  CHECK(f.stats().num_cross_stream_reuses == 0);
  void* q = f.alloc.allocate(70_MiB, f.s3);  // oversize and close enough: borrowed whole
  CHECK(q == big);
  CHECK(f.alloc.allocation_size(q) == 80_MiB);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(q);
  f.sim.complete_all_events();
}

TEST_CASE("stream safety: among equal blocks of other streams, the stream served first lends", "[stream_safety]") {
  // s2 is served before s1 although s1's handle is the lower: the choice
  // follows the program's order, not the handles' values.
  sim_fixture f(manual_events());
  REQUIRE(f.s1 < f.s2);
  void* second_first = f.alloc.allocate(20_MiB, f.s2);
  void* first_later = f.alloc.allocate(20_MiB, f.s1);
  REQUIRE(f.alloc.allocation_size(second_first) == f.alloc.allocation_size(first_later));
  f.alloc.free(first_later);
  f.alloc.free(second_first);
  void* q = f.alloc.allocate(20_MiB, f.s3);
  CHECK(q == second_first);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  f.check_consistent();
  f.alloc.free(q);
  f.sim.complete_all_events();
}
