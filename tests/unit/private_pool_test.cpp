// Private pools as torch.cuda.MemPool, use_mem_pool and CUDA graph trees use
// them, on the simulated device: use counts, segments from a pool's own
// segment_source, use_on_oom, no_split, empty_cache of one pool, a memory
// fraction of 0, checkpoints and their restore, and the ranges CUDA IPC
// shares.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "streamalloc/core/pool_checkpoint.hpp"
#include "streamalloc/core/segment_source.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::find_block;
using streamalloc::test::find_segment;
using streamalloc::test::manual_events;
using streamalloc::test::plain_device;
using streamalloc::test::sim_fixture;
using streamalloc::test::vmm_device;

namespace {

// A MemPool allocator: hands out sim segments, counting what it does, and
// can refuse like a full device.
class counting_source final : public segment_source {
 public:
  explicit counting_source(sim_backend& sim) : sim_(sim) {}

  status allocate_segment(std::size_t bytes, stream_handle stream, void** out) override {
    ++allocate_calls;
    if (fail_next > 0 || fail_always) {
      if (fail_next > 0) --fail_next;
      return {fail_code, "counting_source refuses"};
    }
    const status st = sim_.allocate_segment(bytes, out);
    if (st) live[addr(*out)] = {bytes, stream};
    return st;
  }
  status free_segment(void* ptr, std::size_t bytes, stream_handle stream) override {
    ++free_calls;
    auto it = live.find(addr(ptr));
    if (it == live.end() || it->second.bytes != bytes || it->second.stream != stream) {
      return {status_code::invalid_argument, "counting_source: not a segment it gave out"};
    }
    live.erase(it);
    return sim_.free_segment(ptr, bytes);
  }

  struct given {
    std::size_t bytes;
    stream_handle stream;
  };
  std::size_t allocate_calls = 0;
  std::size_t free_calls = 0;
  int fail_next = 0;
  bool fail_always = false;
  status_code fail_code = status_code::out_of_memory;
  std::map<std::uintptr_t, given> live;  // segments handed out and not yet returned

 private:
  sim_backend& sim_;
};

allocator_config no_cross_stream() {
  allocator_config c;
  c.cross_stream_reuse = false;
  return c;
}

// Routes allocations on `stream` to `pool` until end_allocate_to_pool.
void route(sim_fixture& f, pool_id pool, stream_handle stream) {
  f.alloc.begin_allocate_to_pool(pool, [stream](stream_handle s) { return s == stream; });
}

pool_id pool_of(const sim_fixture& f, const void* p) {
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  return seg->pool;
}

std::size_t segments_of(const sim_fixture& f, pool_id pool) {
  const allocator_snapshot snap = f.snapshot();
  return static_cast<std::size_t>(std::count_if(snap.segments.begin(), snap.segments.end(),
                                                [&](const segment_info& s) { return s.pool == pool; }));
}

// The snapshot segments of `pool`, for comparing layouts.
std::vector<segment_info> pool_layout(const sim_fixture& f, pool_id pool) {
  std::vector<segment_info> out;
  for (const segment_info& s : f.snapshot().segments) {
    if (s.pool == pool) out.push_back(s);
  }
  return out;
}

void check_same_blocks(const segment_info& have, const segment_info& want) {
  CHECK(have.address == want.address);
  CHECK(have.total_size == want.total_size);
  REQUIRE(have.blocks.size() == want.blocks.size());
  for (std::size_t i = 0; i < have.blocks.size(); ++i) {
    CAPTURE(i);
    CHECK(have.blocks[i].address == want.blocks[i].address);
    CHECK(have.blocks[i].size == want.blocks[i].size);
    CHECK(have.blocks[i].requested_size == want.blocks[i].requested_size);
    CHECK(have.blocks[i].stream == want.blocks[i].stream);
    CHECK(have.blocks[i].state == want.blocks[i].state);
  }
}

std::set<void*> as_set(const std::vector<void*>& v) { return {v.begin(), v.end()}; }

}  // namespace

// --- use counts -------------------------------------------------------------

TEST_CASE("private pools: create_or_incref, begin and release keep one use count", "[private_pool]") {
  sim_fixture f(plain_device(), no_cross_stream());
  CHECK(f.alloc.pool_use_count(5) == 0);  // unknown
  f.alloc.create_or_incref_pool(5);       // MemPool.__init__
  CHECK(f.alloc.pool_use_count(5) == 1);
  f.alloc.create_or_incref_pool(5);
  CHECK(f.alloc.pool_use_count(5) == 2);
  f.alloc.release_pool(5);
  CHECK(f.alloc.pool_use_count(5) == 1);

  // use_mem_pool: begin, allocate, end, release.
  route(f, 5, f.s1);
  CHECK(f.alloc.pool_use_count(5) == 2);
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* q = f.alloc.allocate(30_MiB, f.s1);
  void* outside = f.alloc.allocate(4_KiB, f.s2);
  f.alloc.end_allocate_to_pool(5);
  f.alloc.release_pool(5);
  CHECK(f.alloc.pool_use_count(5) == 1);
  CHECK(pool_of(f, p) == 5);
  CHECK(pool_of(f, q) == 5);
  CHECK(pool_of(f, outside) == 0);
  f.check_consistent();

  // A second use_mem_pool block reuses the pool's cache.
  f.alloc.free(p);
  route(f, 5, f.s1);
  void* again = f.alloc.allocate(4_KiB, f.s1);
  CHECK(again == p);
  f.alloc.end_allocate_to_pool(5);
  f.alloc.release_pool(5);
  f.alloc.free(again);

  // A pool in use keeps its cache through empty_cache.
  f.alloc.empty_cache();
  f.alloc.empty_cache(5);
  CHECK(segments_of(f, 5) == 2);

  // MemPool.__del__: releasePool, then emptyCache(pool). The segment of the
  // live q stays; the emptied one goes.
  f.alloc.release_pool(5);
  CHECK(f.alloc.pool_use_count(5) == 0);
  CHECK(segments_of(f, 5) == 2);  // Note [released pools]
  f.alloc.empty_cache(5);
  CHECK(segments_of(f, 5) == 1);
  f.check_consistent();
  // A released pool serves nothing new and keeps its emptied segment until
  // the cache is emptied.
  f.alloc.free(q);
  CHECK(segments_of(f, 5) == 1);
  f.alloc.empty_cache(5);
  CHECK(segments_of(f, 5) == 0);
  CHECK(f.alloc.pool_use_count(5) == 0);
  REQUIRE_THROWS_AS(f.alloc.release_pool(5), usage_error);
  f.alloc.free(outside);
  f.check_consistent();
}

TEST_CASE("private pools: misuse of pool ids throws usage_error", "[private_pool]") {
  sim_fixture f;
  REQUIRE_THROWS_AS(f.alloc.create_or_incref_pool(0), usage_error);
  REQUIRE_THROWS_AS(f.alloc.release_pool(3), usage_error);
  REQUIRE_THROWS_AS(f.alloc.set_pool_use_on_oom(3, true), usage_error);
  REQUIRE_THROWS_AS(f.alloc.set_pool_no_split(3, true), usage_error);
  REQUIRE_THROWS_AS(f.alloc.set_pool_use_on_oom(0, true), usage_error);
  REQUIRE_THROWS_AS(f.alloc.checkpoint_pool(3), usage_error);
  REQUIRE_THROWS_AS(f.alloc.pool_allocations_match(3, {}), usage_error);
  pool_checkpoint unknown;
  unknown.pool = 3;
  REQUIRE_THROWS_AS(f.alloc.restore_pool(unknown), usage_error);
  f.alloc.empty_cache(3);  // unknown: nothing to do
  CHECK(f.alloc.pool_use_count(3) == 0);
  f.check_consistent();
}

// --- segment sources --------------------------------------------------------

TEST_CASE("private pools: a segment_source provides the pool's segments and takes them back", "[private_pool]") {
  sim_fixture f(plain_device(), no_cross_stream());
  auto source = std::make_shared<counting_source>(f.sim);
  f.alloc.create_or_incref_pool(3, source);
  f.alloc.create_or_incref_pool(3, std::make_shared<counting_source>(f.sim));  // only honoured at creation
  f.alloc.release_pool(3);

  route(f, 3, f.s1);
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* q = f.alloc.allocate(12_MiB, f.s1);
  f.alloc.end_allocate_to_pool(3);
  f.alloc.release_pool(3);
  CHECK(source->allocate_calls == 2);
  REQUIRE(source->live.size() == 2);
  CHECK(source->live.begin()->second.stream == f.s1);
  std::size_t given_bytes = 0;
  for (const auto& [address, g] : source->live) given_bytes += g.bytes;
  CHECK(given_bytes == 2_MiB + 12_MiB);
  // The source's segments are reserved memory like any other.
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(14_MiB));
  CHECK(f.stats().num_device_alloc == 2);

  // The default pool never uses it.
  void* outside = f.alloc.allocate(4_KiB, f.s1);
  CHECK(source->allocate_calls == 2);
  f.check_consistent();

  f.alloc.free(p);
  f.alloc.free(q);
  f.alloc.empty_cache();
  CHECK(source->free_calls == 0);  // still in use
  f.alloc.release_pool(3);
  f.alloc.empty_cache(3);
  CHECK(source->free_calls == 2);
  CHECK(source->live.empty());
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(2_MiB));
  f.alloc.free(outside);
  f.check_consistent();
}

TEST_CASE("private pools: a segment_source's out_of_memory takes the OOM ladder of a full device", "[private_pool]") {
  // A pool serves only requests routed to it by begin_allocate_to_pool, and
  // while one is underway the ladder neither synchronizes nor releases (as
  // in torch): the same steps as for a backend without room.
  sim_fixture f(plain_device(), no_cross_stream());
  auto source = std::make_shared<counting_source>(f.sim);
  f.alloc.create_or_incref_pool(4, source);
  f.alloc.create_or_incref_pool(5);
  void* cached = f.alloc.allocate(30_MiB, f.s2);
  f.alloc.free(cached);  // an unused default-pool segment
  const auto refused = [&](pool_id pool) {
    route(f, pool, f.s1);
    const device_stats before = f.stats();
    try {
      f.alloc.allocate(4_KiB, f.s1);
      FAIL("allocated without a segment");
    } catch (const out_of_memory& e) {
      CHECK(e.context().requested_bytes == 4_KiB);
    }
    const device_stats after = f.stats();
    CHECK(after.num_alloc_retries == before.num_alloc_retries + 1);
    CHECK(after.num_ooms == before.num_ooms + 1);
    CHECK(f.sim.live_segments() == 1);  // nothing released during the capture
    f.alloc.end_allocate_to_pool(pool);
    f.alloc.release_pool(pool);
    f.check_consistent();
  };
  source->fail_next = 1;
  refused(4);
  CHECK(source->allocate_calls == 1);
  f.sim.fail_nth(sim_fault_point::allocate_segment, 1);
  refused(5);
  f.sim.clear_faults();

  // The next request gets its segment from the source.
  route(f, 4, f.s1);
  void* p = f.alloc.allocate(4_KiB, f.s1);
  CHECK(pool_of(f, p) == 4);
  CHECK(source->allocate_calls == 2);
  SECTION("any other failure is a device_failure") {
    source->fail_next = 1;
    source->fail_code = status_code::device_error;
    REQUIRE_THROWS_AS(f.alloc.allocate(30_MiB, f.s1), device_failure);
    f.check_consistent();
  }
  f.alloc.end_allocate_to_pool(4);
  f.alloc.release_pool(4);
  f.alloc.free(p);
  f.alloc.release_pool(4);
  f.alloc.release_pool(5);
  f.alloc.empty_cache();
  CHECK(source->live.empty());
  CHECK(f.sim.used_bytes() == 0);
}

TEST_CASE("private pools: the allocator's destructor returns a source's segments to it", "[private_pool]") {
  auto f = std::make_unique<sim_fixture>();
  auto source = std::make_shared<counting_source>(f->sim);
  f->alloc.create_or_incref_pool(2, source);
  route(*f, 2, f->s1);
  void* p = f->alloc.allocate(4_KiB, f->s1);
  (void)p;  // still live at destruction
  f->alloc.end_allocate_to_pool(2);
  REQUIRE(source->live.size() == 1);
  f.reset();
  CHECK(source->live.empty());
  CHECK(source->free_calls == 1);
}

// --- use_on_oom and no_split -------------------------------------------------

TEST_CASE("private pools: a use_on_oom pool lends cached blocks before anything is released", "[private_pool]") {
  sim_fixture f(plain_device(60_MiB), no_cross_stream());
  f.alloc.create_or_incref_pool(4);
  f.alloc.set_pool_use_on_oom(4, true);
  route(f, 4, f.s1);
  void* lent = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.end_allocate_to_pool(4);
  f.alloc.release_pool(4);
  f.alloc.free(lent);  // cached in pool 4
  void* full = f.alloc.allocate(30_MiB, f.s2);  // the device is full now
  const device_stats before = f.stats();

  SECTION("a default-pool request on the block's stream takes it") {
    void* p = f.alloc.allocate(20_MiB, f.s1);
    CHECK(p == lent);
    CHECK(pool_of(f, p) == 4);
    const device_stats after = f.stats();
    CHECK(after.num_alloc_retries == before.num_alloc_retries);  // nothing was released
    CHECK(after.num_device_free == before.num_device_free);
    CHECK(after.num_ooms == 0);
    // Split as any block of the pool; the rest stays the pool's.
    CHECK(f.alloc.allocation_size(p) == 20_MiB);
    f.check_consistent();
    f.alloc.free(p);
    // Freed, it is the pool's again: a default request that can grow does
    // not get it.
    f.alloc.free(full);
    f.alloc.empty_cache();
    void* q = f.alloc.allocate(20_MiB, f.s1);
    CHECK(q != lent);
    CHECK(pool_of(f, q) == 0);
    f.alloc.free(q);
    full = nullptr;
  }
  SECTION("another stream's request does not") {
    REQUIRE_THROWS_AS(f.alloc.allocate(20_MiB, f.s3), out_of_memory);
  }
  SECTION("without the flag the pool lends nothing") {
    f.alloc.set_pool_use_on_oom(4, false);
    REQUIRE_THROWS_AS(f.alloc.allocate(20_MiB, f.s1), out_of_memory);
    CHECK(segments_of(f, 4) == 1);  // a pool in use keeps its cache through the ladder
  }
  SECTION("a request of another private pool does not") {
    f.alloc.create_or_incref_pool(6);
    route(f, 6, f.s1);
    REQUIRE_THROWS_AS(f.alloc.allocate(20_MiB, f.s1), out_of_memory);
    f.alloc.end_allocate_to_pool(6);
    f.alloc.release_pool(6);
    f.alloc.release_pool(6);
  }
  f.check_consistent();
  f.alloc.free(full);
  f.alloc.release_pool(4);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
}

TEST_CASE("private pools: a no_split pool hands out whole segments", "[private_pool]") {
  sim_fixture f(plain_device(), no_cross_stream());
  f.alloc.create_or_incref_pool(8);
  f.alloc.set_pool_no_split(8, true);
  route(f, 8, f.s1);
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* b = f.alloc.allocate(4_KiB, f.s1);
  void* c = f.alloc.allocate(2_MiB, f.s1);
  void* d = f.alloc.allocate(11_MiB, f.s1);
  CHECK(f.alloc.allocation_size(a) == 2_MiB);
  CHECK(f.alloc.allocation_size(b) == 2_MiB);
  CHECK(addr(b) != addr(a) + 4_KiB);
  CHECK(f.alloc.allocation_size(c) == 20_MiB);
  CHECK(f.alloc.allocation_size(d) == 12_MiB);
  const device_stats st = f.stats();
  CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(2_MiB + 2_MiB + 20_MiB + 12_MiB));
  CHECK(all(st.requested_bytes) == static_cast<std::int64_t>(4_KiB + 4_KiB + 2_MiB + 11_MiB));
  CHECK(all(st.segment) == 4);
  // A freed whole block serves a smaller request whole.
  f.alloc.free(a);
  void* e = f.alloc.allocate(1_KiB, f.s1);
  CHECK(e == a);
  CHECK(f.alloc.allocation_size(e) == 2_MiB);
  CHECK(all(f.stats().inactive_split) == 0);
  f.check_consistent();

  SECTION("the default pool still splits") {
    f.alloc.end_allocate_to_pool(8);
    void* x = f.alloc.allocate(4_KiB, f.s1);
    CHECK(f.alloc.allocation_size(x) == 4_KiB);
    f.alloc.free(x);
    route(f, 8, f.s1);
    f.alloc.release_pool(8);
  }
  SECTION("clearing the option splits again") {
    f.alloc.set_pool_no_split(8, false);
    void* x = f.alloc.allocate(4_KiB, f.s1);
    CHECK(f.alloc.allocation_size(x) == 4_KiB);
    f.alloc.free(x);
  }
  f.alloc.end_allocate_to_pool(8);
  for (void* p : {b, c, d, e}) f.alloc.free(p);
  f.check_consistent();
  f.alloc.release_pool(8);
  f.alloc.release_pool(8);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
}

// --- empty_cache of one pool -------------------------------------------------

TEST_CASE("private pools: empty_cache(pool) touches only that pool", "[private_pool]") {
  sim_fixture f(manual_events(), no_cross_stream());
  // Pools 1 (in use) and 2 (released), and the default pool: each with a
  // segment holding a live block and an unused cached segment.
  std::map<pool_id, void*> live;
  for (pool_id id : {1, 2}) {
    f.alloc.create_or_incref_pool(id);
    route(f, id, f.s1);
    live[id] = f.alloc.allocate(4_KiB, f.s1);
    f.alloc.free(f.alloc.allocate(30_MiB, f.s1));
    f.alloc.end_allocate_to_pool(id);
    f.alloc.release_pool(id);
  }
  live[0] = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.free(f.alloc.allocate(30_MiB, f.s1));
  f.alloc.release_pool(2);
  REQUIRE(f.sim.live_segments() == 6);
  f.check_consistent();

  f.alloc.empty_cache(1);  // in use: kept
  f.alloc.empty_cache(77);  // unknown: nothing
  CHECK(f.sim.live_segments() == 6);

  SECTION("a released pool's unused segments go, and nothing else") {
    f.alloc.empty_cache(2);
    CHECK(segments_of(f, 2) == 1);
    CHECK(segments_of(f, 1) == 2);
    CHECK(segments_of(f, 0) == 2);
    f.check_consistent();
  }
  SECTION("only the pool's pending frees are waited for") {
    // Both pending on s3: the default pool's free must stay pending.
    void* other = f.alloc.allocate(4_KiB, f.s1);
    f.alloc.record_stream(other, f.s3);
    f.alloc.free(other);
    f.alloc.record_stream(live[2], f.s3);
    f.alloc.free(live[2]);
    live.erase(2);
    f.alloc.empty_cache(2);
    CHECK(segments_of(f, 2) == 0);
    CHECK(f.alloc.pool_use_count(2) == 0);
    const allocator_snapshot snap = f.snapshot();
    const block_info* blk = find_block(snap, addr(other));
    REQUIRE(blk != nullptr);
    CHECK(blk->state == block_state::active_pending_free);
    f.check_consistent();
    f.sim.complete_all_events();
  }
  SECTION("nothing happens during a capture") {
    route(f, 9, f.s2);
    f.alloc.empty_cache(2);
    CHECK(segments_of(f, 2) == 2);
    f.alloc.end_allocate_to_pool(9);
    f.alloc.release_pool(9);
  }
  SECTION("id 0 is empty_cache(): the default pool and released pools") {
    f.alloc.empty_cache(0);
    CHECK(segments_of(f, 0) == 1);
    CHECK(segments_of(f, 1) == 2);
    CHECK(segments_of(f, 2) == 1);
  }
  for (const auto& [id, p] : live) f.alloc.free(p);
  f.alloc.release_pool(1);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

// --- checkpoints -------------------------------------------------------------

TEST_CASE("private pools: restoring a checkpoint gives back its exact layout", "[private_pool]") {
  sim_fixture f(plain_device(), no_cross_stream());
  const pool_id pool = 11;
  f.alloc.create_or_incref_pool(pool);
  void* outside = f.alloc.allocate(4_KiB, f.s1);
  route(f, pool, f.s1);
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* hole = f.alloc.allocate(8_KiB, f.s1);
  void* c = f.alloc.allocate(1000, f.s1);
  void* d = f.alloc.allocate(12_MiB, f.s1);
  void* e = f.alloc.allocate(3_MiB, f.s1);
  f.alloc.free(hole);
  f.alloc.end_allocate_to_pool(pool);
  f.alloc.release_pool(pool);

  const pool_checkpoint cp = f.alloc.checkpoint_pool(pool);
  const std::vector<segment_info> layout = pool_layout(f, pool);
  const device_stats at_checkpoint = f.stats();
  CHECK(cp.pool == pool);
  REQUIRE(cp.segments.size() == layout.size());
  std::set<void*> recorded_live;
  for (std::size_t i = 0; i < cp.segments.size(); ++i) {
    const pool_checkpoint::segment_state& seg = cp.segments[i];
    CHECK(seg.address == layout[i].address);
    CHECK(seg.size == layout[i].total_size);
    CHECK(seg.is_small == layout[i].is_small);
    REQUIRE(seg.blocks.size() == layout[i].blocks.size());
    for (std::size_t j = 0; j < seg.blocks.size(); ++j) {
      CHECK(seg.blocks[j].address == layout[i].blocks[j].address);
      CHECK(seg.blocks[j].size == layout[i].blocks[j].size);
      CHECK(seg.blocks[j].requested_size == layout[i].blocks[j].requested_size);
      CHECK(seg.blocks[j].stream == f.s1);
      if (seg.blocks[j].allocated) recorded_live.insert(reinterpret_cast<void*>(seg.blocks[j].address));
    }
  }
  CHECK(recorded_live == std::set<void*>{a, c, d, e});
  CHECK(f.alloc.pool_allocations_match(pool, {a, c, d, e}));
  CHECK(f.alloc.pool_allocations_match(pool, {e, d, c, a, a}));  // order and repeats do not matter
  CHECK_FALSE(f.alloc.pool_allocations_match(pool, {a, c, d}));
  CHECK_FALSE(f.alloc.pool_allocations_match(pool, {a, c, d, e, outside}));

  // The program goes on: frees, new allocations (one in a new segment), a
  // stream use on a live block.
  route(f, pool, f.s1);
  f.alloc.free(a);
  f.alloc.free(d);
  void* g = f.alloc.allocate(2_KiB, f.s1);  // into the freed holes
  void* big = f.alloc.allocate(40_MiB, f.s1);
  f.alloc.end_allocate_to_pool(pool);
  f.alloc.release_pool(pool);
  f.alloc.record_stream(c, f.s2);
  const std::size_t new_segment = addr(big);
  f.check_consistent();
  CHECK_FALSE(f.alloc.pool_allocations_match(pool, {a, c, d, e}));

  const std::size_t records = f.sim.counters().event_records;
  const pool_restore_result result = f.alloc.restore_pool(cp);
  f.check_consistent();
  CHECK(as_set(result.freed) == std::set<void*>{c, e, g, big});
  CHECK(as_set(result.allocated) == std::set<void*>{a, c, d, e});
  CHECK(f.sim.counters().event_records == records);  // c's stream use was dropped, not waited for
  CHECK(f.alloc.pool_allocations_match(pool, {a, c, d, e}));

  // The checkpointed segments are exactly as recorded; the new one stays, free.
  const std::vector<segment_info> now = pool_layout(f, pool);
  REQUIRE(now.size() == layout.size() + 1);
  std::size_t checked = 0;
  for (const segment_info& seg : now) {
    if (seg.address == new_segment) {
      REQUIRE(seg.blocks.size() == 1);
      CHECK(seg.blocks[0].state == block_state::inactive);
      continue;
    }
    REQUIRE(checked < layout.size());
    check_same_blocks(seg, layout[checked++]);
  }
  const device_stats restored = f.stats();
  const auto same = [](const char* name, const stat_array& have, const stat_array& want) {
    CAPTURE(name);
    CHECK(all(have) == all(want));
  };
  same("allocation", restored.allocation, at_checkpoint.allocation);
  same("allocated_bytes", restored.allocated_bytes, at_checkpoint.allocated_bytes);
  same("requested_bytes", restored.requested_bytes, at_checkpoint.requested_bytes);
  same("active_bytes", restored.active_bytes, at_checkpoint.active_bytes);
  same("inactive_split", restored.inactive_split, at_checkpoint.inactive_split);
  same("inactive_split_bytes", restored.inactive_split_bytes, at_checkpoint.inactive_split_bytes);

  SECTION("restoring again changes nothing but the ownership of the same blocks") {
    const pool_restore_result again = f.alloc.restore_pool(cp);
    CHECK(as_set(again.freed) == std::set<void*>{a, c, d, e});
    CHECK(as_set(again.allocated) == std::set<void*>{a, c, d, e});
    f.check_consistent();
  }
  SECTION("the restored blocks belong to the caller, who frees them") {
    for (void* p : {a, c, d, e}) f.alloc.free(p);
    CHECK(f.sim.counters().event_records == records);
    CHECK(f.alloc.pool_allocations_match(pool, {}));
    f.check_consistent();
  }
  SECTION("a block awaiting stream events blocks both checkpoint and restore") {
    sim_fixture m(manual_events(), no_cross_stream());
    m.alloc.create_or_incref_pool(1);
    route(m, 1, m.s1);
    void* p = m.alloc.allocate(4_KiB, m.s1);
    void* q = m.alloc.allocate(4_KiB, m.s1);
    m.alloc.end_allocate_to_pool(1);
    const pool_checkpoint before = m.alloc.checkpoint_pool(1);
    m.alloc.record_stream(q, m.s2);
    m.alloc.free(q);
    const auto stats_before = m.stats().to_map();
    REQUIRE_THROWS_AS(m.alloc.checkpoint_pool(1), usage_error);
    REQUIRE_THROWS_AS(m.alloc.restore_pool(before), usage_error);
    CHECK(m.stats().to_map() == stats_before);
    CHECK(m.alloc.owns(p));
    m.check_consistent();
    m.sim.complete_all_events();
    m.alloc.free(m.alloc.allocate(512, m.s1));  // reclaims the completed free
    const pool_restore_result r = m.alloc.restore_pool(before);
    CHECK(as_set(r.allocated) == std::set<void*>{p, q});
    m.check_consistent();
  }
  for (void* p : {a, c, d, e}) {
    if (f.alloc.owns(p)) f.alloc.free(p);
  }
  f.alloc.free(outside);
  f.alloc.release_pool(pool);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

TEST_CASE("private pools: restore_pool refuses a checkpoint it cannot apply, changing nothing", "[private_pool]") {
  sim_fixture f(plain_device(), no_cross_stream());
  f.alloc.create_or_incref_pool(3);
  route(f, 3, f.s1);
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* q = f.alloc.allocate(12_MiB, f.s1);
  f.alloc.end_allocate_to_pool(3);
  f.alloc.release_pool(3);
  const pool_checkpoint cp = f.alloc.checkpoint_pool(3);
  REQUIRE(cp.segments.size() == 2);
  const auto before = f.stats().to_map();

  const auto refused = [&](const pool_checkpoint& bad) {
    REQUIRE_THROWS_AS(f.alloc.restore_pool(bad), usage_error);
    CHECK(f.stats().to_map() == before);
    CHECK(f.alloc.pool_allocations_match(3, {p, q}));
    f.check_consistent();
  };
  SECTION("a segment that is not the pool's") {
    pool_checkpoint bad = cp;
    bad.segments[0].address += 512;
    bad.segments[0].blocks[0].address += 512;
    refused(bad);
  }
  SECTION("a segment of another size") {
    pool_checkpoint bad = cp;
    bad.segments[1].size += 2_MiB;
    bad.segments[1].blocks.back().size += 2_MiB;
    refused(bad);
  }
  SECTION("blocks that do not tile the segment") {
    pool_checkpoint bad = cp;
    bad.segments[0].blocks.back().size -= 512;
    refused(bad);
    bad = cp;
    bad.segments[0].blocks[0].address += 512;
    refused(bad);
  }
  SECTION("the same segment twice") {
    pool_checkpoint bad = cp;
    bad.segments[1] = bad.segments[0];
    refused(bad);
  }
  SECTION("a checkpoint of another pool, or of a released one") {
    pool_checkpoint bad = cp;
    bad.pool = 4;
    refused(bad);
    f.alloc.release_pool(3);
    REQUIRE_THROWS_AS(f.alloc.restore_pool(cp), usage_error);
    REQUIRE_THROWS_AS(f.alloc.checkpoint_pool(3), usage_error);
    f.alloc.create_or_incref_pool(3);  // in use again: the segments are still there
    f.alloc.restore_pool(cp);
  }
  f.alloc.free(p);
  f.alloc.free(q);
  f.alloc.release_pool(3);
  f.check_consistent();
}

TEST_CASE("private pools: restore cuts any recorded tiling, streams included", "[private_pool]") {
  // Graph trees only restore what checkpoint_pool recorded; a layout written
  // by hand exercises blocks of several streams in one segment.
  sim_fixture f(plain_device(), no_cross_stream());
  f.alloc.create_or_incref_pool(5);
  route(f, 5, f.s1);
  void* p = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.end_allocate_to_pool(5);
  f.alloc.release_pool(5);
  pool_checkpoint cp = f.alloc.checkpoint_pool(5);
  REQUIRE(cp.segments.size() == 1);
  const std::uintptr_t base = cp.segments[0].address;
  // [s1 live 4K][s2 free 4K][s2 free 8K][s1 live 1K][s1 free rest]
  cp.segments[0].blocks = {{base, 4_KiB, 4000, f.s1, true},
                           {base + 4_KiB, 4_KiB, 0, f.s2, false},
                           {base + 8_KiB, 8_KiB, 0, f.s2, false},
                           {base + 16_KiB, 1_KiB, 1000, f.s1, true},
                           {base + 17_KiB, 2_MiB - 17_KiB, 0, f.s1, false}};
  const pool_restore_result r = f.alloc.restore_pool(cp);
  CHECK(as_set(r.freed) == std::set<void*>{p});
  CHECK(as_set(r.allocated) ==
        std::set<void*>{reinterpret_cast<void*>(base), reinterpret_cast<void*>(base + 16_KiB)});
  f.check_consistent();
  const std::vector<segment_info> layout = pool_layout(f, 5);
  REQUIRE(layout.size() == 1);
  REQUIRE(layout[0].blocks.size() == 4);  // the two free s2 blocks coalesced
  CHECK(layout[0].blocks[1].size == 12_KiB);
  CHECK(layout[0].blocks[1].stream == f.s2);
  CHECK(layout[0].blocks[3].stream == f.s1);
  CHECK(all(f.stats().requested_bytes) == 5000);
  CHECK(all(f.stats().inactive_split) == 2);
  // The s2 hole serves s2 only.
  route(f, 5, f.s2);
  void* s2_block = f.alloc.allocate(12_KiB, f.s2);
  CHECK(addr(s2_block) == base + 4_KiB);
  f.alloc.end_allocate_to_pool(5);
  f.alloc.release_pool(5);
  f.check_consistent();
  for (void* x : r.allocated) f.alloc.free(x);
  f.alloc.free(s2_block);
  f.alloc.release_pool(5);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

// --- CUDA IPC ------------------------------------------------------------------

TEST_CASE("private pools: share_range covers a plain segment whole", "[private_pool]") {
  sim_fixture f;
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* q = f.alloc.allocate(8_KiB, f.s1);
  const caching_allocator::shareable_range r = f.alloc.share_range(q);
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(q));
  REQUIRE(seg != nullptr);
  CHECK(r.address == seg->address);
  CHECK(r.size == 2_MiB);
  CHECK_FALSE(r.expandable);
  CHECK(r.chunk_bytes == 0);
  CHECK(r.chunks.empty());
  REQUIRE_THROWS_AS(f.alloc.share_range(static_cast<char*>(q) + 512), usage_error);
  f.alloc.free(q);
  REQUIRE_THROWS_AS(f.alloc.share_range(q), usage_error);
  f.alloc.free(p);
}

TEST_CASE("private pools: share_range gives the chunks under an expandable block", "[private_pool]") {
  sim_fixture f(vmm_device());
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s1);
  void* c = f.alloc.allocate(2_MiB + 512, f.s1);
  REQUIRE(addr(b) == addr(a) + 3_MiB);
  REQUIRE(addr(c) == addr(b) + 3_MiB);
  const std::uintptr_t base = find_segment(f.snapshot(), addr(a))->address;
  REQUIRE(base == addr(a));

  const auto ra = f.alloc.share_range(a);  // [0, 3) MiB: chunks 0 and 1
  CHECK(ra.expandable);
  CHECK(ra.chunk_bytes == 2_MiB);
  CHECK(ra.address == base);
  CHECK(ra.size == 4_MiB);
  REQUIRE(ra.chunks.size() == 2);
  const auto rb = f.alloc.share_range(b);  // [3, 6) MiB: chunks 1 and 2
  CHECK(rb.address == base + 2_MiB);
  CHECK(rb.size == 4_MiB);
  REQUIRE(rb.chunks.size() == 2);
  CHECK(rb.chunks[0] == ra.chunks[1]);
  const auto rc = f.alloc.share_range(c);  // [6, 8 MiB + 512): chunks 3 and 4
  CHECK(rc.address == base + 6_MiB);
  CHECK(rc.size == 4_MiB);
  REQUIRE(rc.chunks.size() == 2);
  std::vector<physical_handle> all_chunks{ra.chunks[0], ra.chunks[1], rb.chunks[1], rc.chunks[0], rc.chunks[1]};
  CHECK(std::find(all_chunks.begin(), all_chunks.end(), physical_handle{0}) == all_chunks.end());
  std::sort(all_chunks.begin(), all_chunks.end());
  CHECK(std::adjacent_find(all_chunks.begin(), all_chunks.end()) == all_chunks.end());
  CHECK(static_cast<std::int64_t>(all_chunks.size()) == f.stats().mapped_chunks.current);
  REQUIRE_THROWS_AS(f.alloc.share_range(static_cast<char*>(b) + 512), usage_error);
  for (void* p : {a, b, c}) f.alloc.free(p);
  f.check_consistent();
}
