// Expandable segments and stitching on the simulated device: growth in
// place, chunk accounting, stitching instead of growth (and only after the
// donors' streams finished), empty_cache, the memory cap, the chunk-size
// key, the plain fallback, and device faults in reserve/create/map/unmap.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

allocator_config without_stitching() {
  allocator_config c;
  c.stitching = false;
  return c;
}

std::int64_t reserved(const sim_fixture& f) { return all(f.stats().reserved_bytes); }

}  // namespace

TEST_CASE("expandable: consecutive allocations pack into one growing range", "[expandable]") {
  sim_fixture f(vmm_device());
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s1);
  void* c = f.alloc.allocate(3_MiB, f.s1);
  f.check_consistent();
  // Each starts where the previous ends: the tail of the last chunk is used.
  CHECK(addr(b) == addr(a) + 3_MiB);
  CHECK(addr(c) == addr(b) + 3_MiB);
  CHECK(reserved(f) == static_cast<std::int64_t>(10_MiB));  // 9 MiB in 2 MiB chunks
  CHECK(f.sim.live_ranges() == 1);
  CHECK(f.sim.live_segments() == 0);
  CHECK(all(f.stats().segment) == 1);  // one mapped run
  CHECK(f.stats().mapped_chunks.current == 5);

  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].is_expandable);
  CHECK_FALSE(snap.segments[0].is_stitched);
  CHECK(snap.segments[0].total_size == 10_MiB);

  // Freed memory stays cached and mapped, and serves the next request.
  for (void* p : {a, b, c}) f.alloc.free(p);
  const std::int64_t maps = f.stats().num_chunk_maps;
  void* again = f.alloc.allocate(9_MiB, f.s1);
  CHECK(again == a);
  CHECK(f.stats().num_chunk_maps == maps);
  f.check_consistent();
  f.alloc.free(again);
}

TEST_CASE("expandable: a mapped run is reported under its first block's stream", "[expandable]") {
  // The range was reserved for s1's request; after s1's memory goes back,
  // the one run left holds s2's block only.
  sim_fixture f(vmm_device());
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s2);
  f.alloc.free(a);
  f.alloc.empty_cache();
  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].address == addr(b));
  CHECK(snap.segments[0].stream == f.s2);
  f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("expandable: a block beside another stream's starts at a chunk boundary when that saves a chunk",
          "[expandable]") {
  // Note [chunk-aligned starts]. s2's block P ends 1 MiB into chunk 1; the
  // free 5 MiB after it goes to s1, whose 4 MiB request would touch chunks
  // 1-3 at the front of it and touches only chunks 2-3 from the boundary.
  sim_fixture f(vmm_device());
  void* p = f.alloc.allocate(3_MiB, f.s2);
  void* q = f.alloc.allocate(5_MiB, f.s2);  // packs behind p: [3, 8) MiB
  REQUIRE(addr(q) == addr(p) + 3_MiB);
  f.alloc.free(q);
  void* r = f.alloc.allocate(4_MiB, f.s1);  // borrows s2's free block
  CHECK(addr(r) == addr(p) + 4_MiB);
  f.check_consistent();
  // The piece in front stays free, of s1: s1's next 1 MiB request takes it.
  void* front = f.alloc.allocate(1_MiB, f.s1);
  CHECK(addr(front) == addr(p) + 3_MiB);
  for (void* b : {p, r, front}) f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("expandable: beside a block of its own stream a block stays at the front", "[expandable]") {
  sim_fixture f(vmm_device());
  void* p = f.alloc.allocate(3_MiB, f.s1);
  void* q = f.alloc.allocate(5_MiB, f.s1);
  f.alloc.free(q);
  void* r = f.alloc.allocate(4_MiB, f.s1);
  CHECK(addr(r) == addr(p) + 3_MiB);
  for (void* b : {p, r}) f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("expandable: small requests share chunks of their own range", "[expandable]") {
  sim_fixture f(vmm_device());
  std::vector<void*> small;
  for (int i = 0; i < 100; ++i) small.push_back(f.alloc.allocate(4_KiB, f.s1));
  void* large = f.alloc.allocate(4_MiB, f.s1);
  f.check_consistent();
  CHECK(f.sim.live_ranges() == 2);  // small and large pools grow apart
  CHECK(small_pool(f.stats().reserved_bytes) == static_cast<std::int64_t>(2_MiB));
  CHECK(large_pool(f.stats().reserved_bytes) == static_cast<std::int64_t>(4_MiB));
  for (std::size_t i = 1; i < small.size(); ++i) CHECK(addr(small[i]) == addr(small[i - 1]) + 4_KiB);
  for (void* p : small) f.alloc.free(p);
  f.alloc.free(large);
  f.check_consistent();
}

TEST_CASE("expandable: mid-size requests, plain segments keep 1 MiB", "[expandable]") {
  allocator_config plain;
  plain.expandable_segments = false;
  sim_fixture expandable(vmm_device());
  sim_fixture plain_segments(vmm_device(), plain);
  const auto pool_bytes = [](const sim_fixture& f) {
    const device_stats st = f.stats();
    return std::pair<std::int64_t, std::int64_t>{small_pool(st.allocated_bytes), large_pool(st.allocated_bytes)};
  };
  using bytes_pair = std::pair<std::int64_t, std::int64_t>;
  const auto mib = [](double v) { return static_cast<std::int64_t>(v * static_cast<double>(1_MiB)); };

  // Plain segments: everything up to 1 MiB is small.
  {
    sim_fixture& f = plain_segments;
    void* at_limit = f.alloc.allocate(384_KiB, f.s1);
    void* above = f.alloc.allocate(384_KiB + 512, f.s1);
    void* one_mib = f.alloc.allocate(1_MiB, f.s1);
    f.check_consistent();
    CHECK(pool_bytes(f) == bytes_pair{384_KiB + 384_KiB + 512 + 1_MiB, 0});
    for (void* p : {at_limit, above, one_mib}) f.alloc.free(p);
  }

  // Expandable segments, Note [mid-size requests].
  sim_fixture& f = expandable;
  // A stream without a free small block: a small chunk, as torch would.
  void* first = f.alloc.allocate(1_MiB, f.s1);
  CHECK(pool_bytes(f) == bytes_pair{mib(1), 0});
  void* big = f.alloc.allocate(4_MiB, f.s1);  // two whole chunks: no large free block
  CHECK(pool_bytes(f) == bytes_pair{mib(1), mib(4)});
  // No large free block fits, a small one does.
  void* mid = f.alloc.allocate(512_KiB, f.s1);
  CHECK(pool_bytes(f) == bytes_pair{mib(1.5), mib(4)});
  // Neither fits: the stream has a free small block, so the large range grows.
  void* mid2 = f.alloc.allocate(768_KiB, f.s1);
  CHECK(pool_bytes(f) == bytes_pair{mib(1.5), mib(4.75)});
  // Both fit: the large free block (the rest of the last chunk) first.
  f.alloc.free(mid);
  void* mid3 = f.alloc.allocate(512_KiB, f.s1);
  CHECK(pool_bytes(f) == bytes_pair{mib(1), mib(5.25)});
  CHECK(addr(mid3) == addr(mid2) + 768_KiB);
  // 384 KiB is small whatever the large pool holds.
  void* at_limit = f.alloc.allocate(384_KiB, f.s1);
  CHECK(pool_bytes(f) == bytes_pair{mib(1.375), mib(5.25)});
  f.check_consistent();
  for (void* p : {first, big, mid2, mid3, at_limit}) f.alloc.free(p);
  f.check_consistent();

  // A graph-capture pool is made of plain segments: 1 MiB limit there too.
  expandable.alloc.begin_allocate_to_pool(3, [&](stream_handle s) { return s == expandable.s2; });
  void* captured = expandable.alloc.allocate(1_MiB, expandable.s2);
  expandable.alloc.end_allocate_to_pool(3);
  CHECK(small_pool(expandable.stats().allocated_bytes) == static_cast<std::int64_t>(1_MiB));
  CHECK(find_segment(expandable.snapshot(), addr(captured))->is_small);
  expandable.alloc.free(captured);
  expandable.alloc.release_pool(3);
  expandable.check_consistent();
}

TEST_CASE("expandable: stitching moves idle chunks instead of growing", "[expandable]") {
  sim_fixture f(vmm_device());
  const std::vector<void*> kept = make_two_holes(f, f.s1);
  REQUIRE(reserved(f) == static_cast<std::int64_t>(12_MiB));
  const std::size_t creates_before = f.sim.live_chunks();

  // No mapped free block holds 8 MiB, but the holes hold four idle chunks.
  void* big = f.alloc.allocate(8_MiB, f.s1);
  f.check_consistent();
  const device_stats st = f.stats();
  CHECK(reserved(f) == static_cast<std::int64_t>(12_MiB));
  CHECK(f.sim.live_chunks() == creates_before);
  CHECK(st.num_stitched_blocks == 1);
  CHECK(st.num_chunk_unmaps == 4);
  CHECK(st.num_stitch_syncs == 1);
  CHECK(st.reserved_bytes[0].peak == static_cast<std::int64_t>(12_MiB));

  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(big));
  REQUIRE(seg != nullptr);
  CHECK(seg->is_stitched);
  CHECK(seg->is_expandable);
  // The holes are gone from the snapshot: only mapped runs are segments.
  CHECK(find_segment(snap, addr(kept[0]) - 4_MiB) == nullptr);

  f.alloc.free(big);
  for (void* p : kept) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: stitching takes first the holes that strand no free bytes", "[expandable]") {
  // Note [stranded bytes]: hole A (4.5 MiB, two idle chunks) leaves 0.5 MiB
  // free in the chunk it shares with the block before it once its chunks go;
  // hole B (6 MiB, three idle chunks) lies on chunk boundaries and leaves
  // none. B gives its chunks first although A is the smaller hole.
  sim_fixture f(vmm_device());
  void* x0 = f.alloc.allocate(1536_KiB, f.s1);
  void* a = f.alloc.allocate(4608_KiB, f.s1);
  void* x1 = f.alloc.allocate(2_MiB, f.s1);
  void* b = f.alloc.allocate(6_MiB, f.s1);
  void* x2 = f.alloc.allocate(2_MiB, f.s1);
  REQUIRE(addr(a) == addr(x0) + 1536_KiB);
  REQUIRE(addr(x1) == addr(a) + 4608_KiB);
  REQUIRE(addr(b) == addr(x1) + 2_MiB);
  REQUIRE(addr(x2) == addr(b) + 6_MiB);
  REQUIRE((addr(b) - addr(x0)) % 2_MiB == 0);
  f.alloc.free(a);
  f.alloc.free(b);
  REQUIRE(reserved(f) == static_cast<std::int64_t>(16_MiB));

  // 7 MiB fits no free block and needs four chunks: B's three, then one of A's.
  void* big = f.alloc.allocate(7_MiB, f.s1);
  f.check_consistent();
  CHECK(f.stats().num_stitched_blocks == 1);
  CHECK(f.stats().num_chunk_unmaps == 4);
  CHECK(reserved(f) == static_cast<std::int64_t>(16_MiB));
  const allocator_snapshot snap = f.snapshot();
  CHECK(find_segment(snap, addr(b)) == nullptr);        // B unmapped whole
  CHECK(find_segment(snap, addr(b) - 1_MiB) != nullptr);  // x1's run
  const segment_info* a_run = find_segment(snap, addr(a));
  REQUIRE(a_run != nullptr);  // A keeps the chunk it shares with x0 and one more
  CHECK(a_run->address + a_run->total_size == addr(x0) + 4_MiB);
  for (void* p : {x0, x1, x2, big}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: without stitching the range grows instead", "[expandable]") {
  sim_fixture f(vmm_device(), without_stitching());
  const std::vector<void*> kept = make_two_holes(f, f.s1);
  void* big = f.alloc.allocate(8_MiB, f.s1);
  f.check_consistent();
  CHECK(reserved(f) == static_cast<std::int64_t>(20_MiB));
  CHECK(f.stats().num_stitched_blocks == 0);
  CHECK(f.stats().num_chunk_unmaps == 0);
  f.alloc.free(big);
  for (void* p : kept) f.alloc.free(p);
}

TEST_CASE("expandable: growth within stitch_slack of the allocation peak does not stitch", "[expandable]") {
  allocator_config roomy;
  roomy.stitch_slack = 1.0;  // reserved may reach twice the peak of allocated memory
  sim_fixture f(vmm_device(), roomy);
  const std::vector<void*> kept = make_two_holes(f, f.s1);
  void* big = f.alloc.allocate(8_MiB, f.s1);  // 20 MiB reserved <= 2 x 12 MiB peak
  f.check_consistent();
  CHECK(f.stats().num_stitched_blocks == 0);
  CHECK(reserved(f) == static_cast<std::int64_t>(20_MiB));
  f.alloc.free(big);
  for (void* p : kept) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: stitching waits for the streams that used the donor blocks", "[expandable]") {
  sim_fixture f(vmm_device(80_GiB, /*manual_events=*/true));
  void* hole1 = f.alloc.allocate(4_MiB, f.s1);
  void* kept1 = f.alloc.allocate(2_MiB, f.s1);
  void* hole2 = f.alloc.allocate(4_MiB, f.s1);
  void* kept2 = f.alloc.allocate(2_MiB, f.s1);
  // Kernels on s1 still use both holes when they are freed.
  f.sim.touch(f.s1, hole1, 4_MiB);
  f.sim.touch(f.s1, hole2, 4_MiB);
  f.alloc.free(hole1);
  f.alloc.free(hole2);
  REQUIRE(f.sim.live_touches() == 2);

  const std::size_t syncs_before = f.sim.counters().event_syncs;
  void* big = f.alloc.allocate(8_MiB, f.s2);
  CHECK(f.sim.counters().event_syncs == syncs_before + 1);
  CHECK(f.sim.counters().unsafe_unmaps == 0);
  CHECK(f.sim.live_touches() == 0);
  CHECK(f.stats().num_stitched_blocks == 1);
  f.check_consistent();
  for (void* p : {big, kept1, kept2}) f.alloc.free(p);
}

TEST_CASE("expandable: a chunk free across blocks of two streams is stitched", "[expandable]") {
  // Note [free runs]: [a: 1 MiB, s1][b: 1 MiB, s2][kept: 2 MiB], a and b
  // freed. No single free block holds a whole chunk, but the first chunk
  // is wholly free. An explicit small-pool limit keeps the 1 MiB requests
  // in the large range (no Note [mid-size requests]).
  allocator_config cfg;
  cfg.small_request_bytes = allocator_config::k_expandable_small_request_bytes;
  sim_fixture f(vmm_device(80_GiB, /*manual_events=*/true), cfg);
  void* a = f.alloc.allocate(1_MiB, f.s1);
  void* b = f.alloc.allocate(1_MiB, f.s1);
  void* kept = f.alloc.allocate(2_MiB, f.s1);
  f.alloc.free(b);
  b = f.alloc.allocate(1_MiB, f.s2);  // s1's free block, handed to s2
  REQUIRE(addr(b) == addr(a) + 1_MiB);
  REQUIRE(addr(kept) == addr(a) + 2_MiB);
  // Kernels on both streams still use the blocks when they are freed.
  f.sim.touch(f.s1, a, 1_MiB);
  f.sim.touch(f.s2, b, 1_MiB);
  f.alloc.free(a);
  f.alloc.free(b);
  f.check_consistent();
  REQUIRE(reserved(f) == static_cast<std::int64_t>(4_MiB));

  const std::size_t syncs_before = f.sim.counters().event_syncs;
  void* big = f.alloc.allocate(2_MiB, f.s1);
  f.check_consistent();
  // The chunk moved instead of a new one being made, after both streams
  // that last used it finished.
  CHECK(reserved(f) == static_cast<std::int64_t>(4_MiB));
  CHECK(f.stats().num_stitched_blocks == 1);
  CHECK(f.sim.counters().event_syncs == syncs_before + 2);
  CHECK(f.sim.counters().unsafe_unmaps == 0);
  CHECK(f.sim.live_touches() == 0);
  for (void* p : {big, kept}) f.alloc.free(p);
  f.check_consistent();
}

// Note [beside the hole]: the free blocks touching the hole a request maps
// into donate their idle chunks too, all but the chunk touching the hole.
TEST_CASE("expandable: stitching takes the idle chunks of the free block before the hole it maps into",
          "[expandable]") {
  allocator_config cfg;
  cfg.cross_stream_reuse = false;  // s2's free block must not serve s1 whole
  sim_fixture f(vmm_device(), cfg);
  void* a = f.alloc.allocate(2_MiB, f.s1);
  void* b = f.alloc.allocate(8_MiB, f.s2);
  REQUIRE(addr(b) == addr(a) + 2_MiB);
  f.alloc.free(b);  // [a 2 MiB][b 8 MiB free, s2][unmapped tail]
  REQUIRE(reserved(f) == static_cast<std::int64_t>(10_MiB));

  // The tail is the only place for 8 MiB of s1, and b touches it: three of
  // b's four chunks move, the one touching the tail stays.
  void* big = f.alloc.allocate(8_MiB, f.s1);
  f.check_consistent();
  CHECK(addr(big) == addr(b) + 8_MiB);
  CHECK(f.stats().num_stitched_blocks == 1);
  CHECK(f.stats().num_chunk_unmaps == 3);
  CHECK(reserved(f) == static_cast<std::int64_t>(12_MiB));  // not 18 MiB
  for (void* p : {a, big}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: stitching takes the idle chunks of the free block after the hole it maps into",
          "[expandable]") {
  allocator_config cfg;
  cfg.cross_stream_reuse = false;
  sim_fixture f(vmm_device(), cfg);
  void* p = f.alloc.allocate(8_MiB, f.s1);
  void* q = f.alloc.allocate(8_MiB, f.s2);
  void* r = f.alloc.allocate(2_MiB, f.s1);
  REQUIRE(addr(q) == addr(p) + 8_MiB);
  f.alloc.free(p);
  f.alloc.empty_cache();  // p's chunks go: [hole 8 MiB][q][r]
  f.alloc.free(q);        // [hole 8 MiB][q 8 MiB free, s2][r]
  f.alloc.reset_peak_stats();
  REQUIRE(reserved(f) == static_cast<std::int64_t>(10_MiB));

  // 6 MiB of s1 maps at the hole's front; q gives the three chunks after
  // its first, which stays mapped beside the hole.
  void* x = f.alloc.allocate(6_MiB, f.s1);
  f.check_consistent();
  CHECK(addr(x) == addr(p));
  CHECK(f.stats().num_stitched_blocks == 1);
  CHECK(reserved(f) == static_cast<std::int64_t>(10_MiB));  // not 16 MiB
  for (void* b : {x, r}) f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("expandable: a request that also takes the front of the free block after its hole stitches that block's tail",
          "[expandable]") {
  sim_fixture f(vmm_device());
  void* w = f.alloc.allocate(2_MiB, f.s2);
  void* p = f.alloc.allocate(8_MiB, f.s1);
  void* q = f.alloc.allocate(8_MiB, f.s2);
  void* r = f.alloc.allocate(2_MiB, f.s1);
  REQUIRE(addr(p) == addr(w) + 2_MiB);
  REQUIRE(addr(q) == addr(p) + 8_MiB);
  f.alloc.free(p);
  f.alloc.empty_cache();
  f.alloc.free(w);
  f.alloc.free(q);  // [w 2 MiB free, s2][hole 8 MiB][q 8 MiB free, s2][r]
  f.alloc.reset_peak_stats();
  REQUIRE(reserved(f) == static_cast<std::int64_t>(12_MiB));
  const std::int64_t unmaps_before = f.stats().num_chunk_unmaps;

  // 14 MiB of s2 continues from w: w, the whole hole and the first 4 MiB
  // of q, which is s2's. The two chunks of q past that part are idle and
  // move into the hole; two chunks are new.
  void* y = f.alloc.allocate(14_MiB, f.s2);
  f.check_consistent();
  CHECK(addr(y) == addr(w));
  CHECK(f.stats().num_stitched_blocks == 1);
  CHECK(f.stats().num_chunk_unmaps == unmaps_before + 2);
  CHECK(reserved(f) == static_cast<std::int64_t>(16_MiB));  // not 20 MiB
  // The moved chunks left a hole where q's tail was; the next request of
  // that size maps there.
  void* z = f.alloc.allocate(4_MiB, f.s2);
  f.check_consistent();
  CHECK(addr(z) == addr(q) + 4_MiB);
  for (void* b : {y, z, r}) f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("expandable: a request that cannot continue the run before its hole ends in the free block after it",
          "[expandable]") {
  sim_fixture f(vmm_device());
  void* p = f.alloc.allocate(8_MiB, f.s1);
  void* q = f.alloc.allocate(9_MiB, f.s2);
  void* r = f.alloc.allocate(1_MiB, f.s2);
  REQUIRE(addr(q) == addr(p) + 8_MiB);
  REQUIRE(addr(r) == addr(q) + 9_MiB);
  f.alloc.free(p);
  f.alloc.empty_cache();
  f.alloc.free(q);  // [hole 8 MiB][q 9 MiB free, s2][r 1 MiB, s2]
  f.alloc.reset_peak_stats();
  REQUIRE(reserved(f) == static_cast<std::int64_t>(10_MiB));

  // 12 MiB of s2 from the hole's front would map the whole hole, four
  // chunks, and take q's first 4 MiB; then two of them would be stitched
  // from q's tail, after a stream wait. Ending in q (Note [the hole's end])
  // maps two: the hole's last 4 MiB, then 8 of q's 9 MiB. Nothing moves.
  void* y = f.alloc.allocate(12_MiB, f.s2);
  f.check_consistent();
  CHECK(addr(y) == addr(p) + 4_MiB);
  CHECK(f.stats().num_stitched_blocks == 0);
  CHECK(f.stats().num_stitch_syncs == 0);
  CHECK(reserved(f) == static_cast<std::int64_t>(14_MiB));
  CHECK(all(f.stats().segment) == 1);  // one mapped run: the new chunks joined q's
  // The hole's front stays free for the next request of its size.
  void* z = f.alloc.allocate(4_MiB, f.s1);
  f.check_consistent();
  CHECK(addr(z) == addr(p));
  for (void* b : {y, z, r}) f.alloc.free(b);
  f.check_consistent();
}

// Note [stitch cycles]: one round of the same fragmentation, then `bytes`
// (level 4 MiB + bytes); true when the request was stitched.
static bool stitch_round(sim_fixture& f, std::size_t bytes) {
  const std::int64_t before = f.stats().num_stitched_blocks;
  const std::vector<void*> kept = make_two_holes(f, f.s1);
  void* p = f.alloc.allocate(bytes, f.s1);
  f.check_consistent();
  const bool stitched = f.stats().num_stitched_blocks == before + 1;
  f.alloc.free(p);
  for (void* k : kept) f.alloc.free(k);
  f.alloc.empty_cache();
  return stitched;
}

// Live memory on another stream, so that a cycle's growth (8 and 6 MiB in
// the rounds above) is within its 2% share of the allocation peak, yet
// past stitch_slack (0.5%), so that the rounds stitch at all.
constexpr std::size_t k_ballast_bytes = 1_GiB;

TEST_CASE("expandable: a stitch that keeps coming back after other stitches grows instead", "[expandable]") {
  sim_fixture f(vmm_device());
  void* ballast = f.alloc.allocate(k_ballast_bytes, f.s2);
  // Two stitches take turns, as in a loop whose stitches undo each other.
  CHECK(stitch_round(f, 8_MiB));
  CHECK(stitch_round(f, 6_MiB));
  CHECK(stitch_round(f, 8_MiB));  // back once: stitched
  CHECK(stitch_round(f, 6_MiB));
  CHECK_FALSE(stitch_round(f, 8_MiB));  // back again: grows
  CHECK_FALSE(stitch_round(f, 6_MiB));
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(k_ballast_bytes + 20_MiB));
  // Another request size at another level is a new stitch.
  CHECK(stitch_round(f, 4_MiB + 2_MiB + 2_MiB - 512_KiB));
  f.alloc.free(ballast);
}

TEST_CASE("expandable: a stitch that comes back at irregular intervals is no cycle and keeps stitching",
          "[expandable]") {
  // The same two stitches as above take turns, but one more allocation
  // every other round puts their recurrences G and G + 1 allocations apart,
  // neither a whole number of the other: not a loop's period, as when a
  // training loop of varying shapes draws a shape again. Growing there
  // would raise the peak for a stitch that may not come back.
  sim_fixture f(vmm_device());
  void* ballast = f.alloc.allocate(k_ballast_bytes, f.s2);
  void* small = f.alloc.allocate(512, f.s2);  // keeps the small chunk the extra allocations use
  for (int round = 0; round < 6; ++round) {
    INFO(round);
    CHECK(stitch_round(f, 8_MiB));
    if (round % 2 == 1) f.alloc.free(f.alloc.allocate(512, f.s2));
    CHECK(stitch_round(f, 6_MiB));
  }
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(k_ballast_bytes + 2_MiB + 12_MiB));
  f.alloc.free(small);
  f.alloc.free(ballast);
}

TEST_CASE("expandable: a cycle stitches on when its growth would pass its share of the allocation peak",
          "[expandable]") {
  // The peak is the rounds' 12 MiB alone: 2% of it is less than a chunk, so
  // the cycle's growth (8 MiB) would raise reserved memory a long way past
  // the peak; the cycle keeps stitching, within k_stitches_per_key.
  sim_fixture f(vmm_device());
  for (int round = 0; round < 4; ++round) {
    INFO(round);
    CHECK(stitch_round(f, 8_MiB));
    CHECK(stitch_round(f, 6_MiB));
  }
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(12_MiB));
}

TEST_CASE("expandable: the growth of every cycle together stays within its share of the allocation peak",
          "[expandable]") {
  // About 512 MiB at the peak: 2% (10.2 MiB) affords the 8 MiB cycle's
  // growth, not the 6 MiB one's on top of it.
  sim_fixture f(vmm_device());
  void* ballast = f.alloc.allocate(500_MiB, f.s2);
  for (int round = 0; round < 2; ++round) {
    INFO(round);
    REQUIRE(stitch_round(f, 8_MiB));
    REQUIRE(stitch_round(f, 6_MiB));
  }
  CHECK_FALSE(stitch_round(f, 8_MiB));  // grows: 8 MiB
  CHECK(stitch_round(f, 6_MiB));        // 6 MiB more would pass the share
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(500_MiB + 20_MiB));
  f.alloc.free(ballast);
}

TEST_CASE("expandable: a stitch that comes back after the growth that should end its cycle stitches again",
          "[expandable]") {
  // Each round ends with empty_cache, so what the growth mapped is gone when
  // the loop comes back, as when other stitches take it: growing again would
  // raise reserved memory again without ending anything.
  sim_fixture f(vmm_device());
  void* ballast = f.alloc.allocate(k_ballast_bytes, f.s2);
  for (int round = 0; round < 2; ++round) {
    INFO(round);
    REQUIRE(stitch_round(f, 8_MiB));
    REQUIRE(stitch_round(f, 6_MiB));
  }
  CHECK_FALSE(stitch_round(f, 8_MiB));  // the cycle's growth, once
  CHECK_FALSE(stitch_round(f, 6_MiB));
  const std::int64_t grown_peak = f.stats().reserved_bytes[0].peak;
  for (int round = 0; round < 3; ++round) {
    INFO(round);
    CHECK(stitch_round(f, 8_MiB));
    CHECK(stitch_round(f, 6_MiB));
  }
  CHECK(f.stats().reserved_bytes[0].peak == grown_peak);
  f.alloc.free(ballast);
}

TEST_CASE("expandable: the same stitch repeated with no other in between keeps stitching", "[expandable]") {
  // Identical layers, each finding the last one's block taken by smaller
  // ones, stitch the same request at the same level one after another.
  sim_fixture f(vmm_device());
  for (int i = 0; i < 6; ++i) {
    INFO(i);
    CHECK(stitch_round(f, 8_MiB));
  }
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(12_MiB));
}

TEST_CASE("expandable: the same stitch repeated without end grows after a bounded number", "[expandable]") {
  // A loop that stitches the same request at the same level in every
  // iteration would synchronize streams in every iteration; after
  // k_stitches_per_key stitches it grows instead.
  sim_fixture f(vmm_device());
  for (int i = 0; i < caching_allocator::k_stitches_per_key; ++i) {
    INFO(i);
    REQUIRE(stitch_round(f, 8_MiB));
  }
  CHECK_FALSE(stitch_round(f, 8_MiB));
  CHECK(f.stats().reserved_bytes[0].peak == static_cast<std::int64_t>(20_MiB));  // grown, as after a cycle
}

TEST_CASE("expandable: blocks with pending stream uses never donate chunks", "[expandable]") {
  sim_fixture f(vmm_device(80_GiB, /*manual_events=*/true));
  void* hole = f.alloc.allocate(4_MiB, f.s1);
  void* kept = f.alloc.allocate(2_MiB, f.s1);
  f.alloc.record_stream(hole, f.s2);
  f.alloc.free(hole);  // pending until s2's event completes
  void* big = f.alloc.allocate(4_MiB, f.s1);
  CHECK(f.stats().num_stitched_blocks == 0);
  CHECK(f.stats().num_chunk_unmaps == 0);
  CHECK(addr(big) == addr(kept) + 2_MiB);
  f.check_consistent();
  f.sim.complete_all_events();
  for (void* p : {big, kept}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: empty_cache unmaps idle chunks and releases empty ranges", "[expandable]") {
  sim_fixture f(vmm_device(80_GiB, /*manual_events=*/true));
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s2);  // shares a chunk with a
  void* c = f.alloc.allocate(8_MiB, f.s1);
  void* small = f.alloc.allocate(4_KiB, f.s1);
  f.sim.touch(f.s1, a, 3_MiB);
  f.sim.touch(f.s2, b, 3_MiB);
  f.alloc.free(a);
  f.alloc.free(b);

  // c and small stay live: only the chunks wholly under free blocks go.
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(f.sim.live_touches() == 0);  // a device synchronization came first
  CHECK(f.sim.counters().unsafe_unmaps == 0);
  CHECK(all(f.stats().allocated_bytes) == static_cast<std::int64_t>(8_MiB + 512_KiB / 128));
  // a and b (6 MiB, of two streams, in chunks 0-2) leave at most the chunk
  // they share with c behind.
  CHECK(large_pool(f.stats().reserved_bytes) <= static_cast<std::int64_t>(10_MiB));

  f.alloc.free(c);
  f.alloc.free(small);
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(f.sim.used_bytes() == 0);
  CHECK(f.sim.live_chunks() == 0);
  CHECK(f.sim.live_ranges() == 0);
  CHECK(reserved(f) == 0);
  CHECK(all(f.stats().segment) == 0);
}

TEST_CASE("expandable: the memory fraction caps mapped memory", "[expandable]") {
  allocator_config cfg;
  cfg.memory_fraction = 0.5;
  sim_fixture f(vmm_device(64_MiB), cfg);
  void* a = f.alloc.allocate(20_MiB, f.s1);
  void* b = f.alloc.allocate(12_MiB, f.s1);
  CHECK(reserved(f) == static_cast<std::int64_t>(32_MiB));
  REQUIRE_THROWS_AS(f.alloc.allocate(2_MiB, f.s1), out_of_memory);
  f.check_consistent();
  // Freeing a makes room: its chunks are reused (or stitched) under the cap.
  f.alloc.free(a);
  void* c = f.alloc.allocate(16_MiB, f.s2);
  CHECK(reserved(f) <= static_cast<std::int64_t>(32_MiB));
  f.check_consistent();
  f.alloc.free(b);
  f.alloc.free(c);
}

TEST_CASE("expandable: an allocation that cannot fit anywhere raises out_of_memory", "[expandable]") {
  sim_fixture f(vmm_device(64_MiB));
  void* a = f.alloc.allocate(40_MiB, f.s1);
  try {
    (void)f.alloc.allocate(40_MiB, f.s1);
    FAIL("a second 40 MiB fit on a 64 MiB device");
  } catch (const out_of_memory& e) {
    CHECK(e.context().requested_bytes == 40_MiB);
    CHECK(e.context().reserved_bytes <= 64_MiB);
  }
  f.check_consistent();
  CHECK(f.sim.live_chunks() == f.sim.mapped_chunks());
  f.alloc.free(a);
  void* b = f.alloc.allocate(60_MiB, f.s1);  // the cache gives way to the new size
  f.check_consistent();
  f.alloc.free(b);
}

TEST_CASE("expandable: requests near SIZE_MAX raise out_of_memory", "[expandable]") {
  sim_fixture f(vmm_device());
  for (std::size_t bytes : {std::numeric_limits<std::size_t>::max() - 24'861, std::numeric_limits<std::size_t>::max() / 2}) {
    REQUIRE_THROWS_AS(f.alloc.allocate(bytes, f.s1), out_of_memory);
    f.check_consistent();
  }
  CHECK(f.sim.live_chunks() == 0);
}

TEST_CASE("expandable: chunk size key", "[expandable]") {
  SECTION("a multiple of the granularity sets the growth step") {
    allocator_config cfg;
    cfg.vmm_chunk_bytes = 8_MiB;
    sim_fixture f(vmm_device(), cfg);
    void* p = f.alloc.allocate(1_MiB + 512, f.s1);
    CHECK(reserved(f) == static_cast<std::int64_t>(8_MiB));
    f.check_consistent();
    f.alloc.free(p);
  }
  SECTION("anything else is refused when the allocator is built") {
    sim_backend sim(vmm_device());
    allocator_config cfg;
    cfg.vmm_chunk_bytes = 3_MiB;
    try {
      caching_allocator alloc(sim, cfg);
      FAIL("a 3 MiB chunk was accepted on a device with 2 MiB granularity");
    } catch (const config_error& e) {
      CHECK(contains(e.what(), "vmm_chunk_mb"));
      CHECK(contains(e.what(), "granularity (2097152 bytes)"));
    }
  }
  SECTION("with expandable segments off it is not used, so not checked until they are turned on") {
    allocator_config cfg;
    cfg.expandable_segments = false;
    cfg.vmm_chunk_bytes = 3_MiB;
    sim_fixture f(vmm_device(), cfg);
    void* p = f.alloc.allocate(3_MiB, f.s1);
    CHECK(f.sim.live_ranges() == 0);
    try {
      f.alloc.update_config(f.alloc.config().with("expandable_segments:True"));
      FAIL("expandable segments were turned on with a 3 MiB chunk on a device with 2 MiB granularity");
    } catch (const config_error& e) {
      CHECK(contains(e.what(), "vmm_chunk_mb"));
    }
    // The refused update changed nothing: requests still get plain segments.
    CHECK_FALSE(f.alloc.config().expandable_segments);
    void* q = f.alloc.allocate(3_MiB, f.s1);
    CHECK(f.sim.live_ranges() == 0);
    f.check_consistent();
    f.alloc.free(p);
    f.alloc.free(q);
  }
}

TEST_CASE("expandable: plain segments when turned off or unsupported", "[expandable]") {
  allocator_config off;
  off.expandable_segments = false;
  sim_fixture turned_off(vmm_device(), off);
  sim_fixture unsupported(plain_device());
  for (sim_fixture* f : {&turned_off, &unsupported}) {
    void* p = f->alloc.allocate(3_MiB, f->s1);
    CHECK(f->sim.live_ranges() == 0);
    CHECK(f->sim.live_segments() == 1);
    CHECK(f->stats().num_chunk_maps == 0);
    CHECK_FALSE(f->snapshot().segments.at(0).is_expandable);
    f->alloc.free(p);
  }
}

TEST_CASE("expandable: max_split_size leaves every free run to every request", "[expandable]") {
  // Note [max_split in expandable segments]: torch's rules would refuse the
  // freed 100 MiB run to a request below the 40 MiB limit and to one more
  // than max_non_split_rounding smaller, and the range would grow.
  allocator_config c;
  c.max_split_bytes = 40_MiB;
  sim_fixture f(vmm_device(), c);
  void* big = f.alloc.allocate(100_MiB, f.s1);
  CHECK(f.stats().oversize_allocations.current == 1);
  f.alloc.free(big);
  const std::int64_t reserved_before = reserved(f);
  const std::int64_t maps_before = f.stats().num_chunk_maps;
  void* below = f.alloc.allocate(10_MiB, f.s1);
  void* oversize = f.alloc.allocate(60_MiB, f.s1);
  CHECK(reserved(f) == reserved_before);
  CHECK(f.stats().num_chunk_maps == maps_before);
  for (void* p : {below, oversize}) {
    CHECK(addr(p) >= addr(big));
    CHECK(addr(p) + f.alloc.allocation_size(p) <= addr(big) + 100_MiB);
  }
  CHECK(f.stats().oversize_allocations.current == 1);  // the 60 MiB request
  f.check_consistent();
  f.alloc.free(below);
  f.alloc.free(oversize);

  // A loop crossing the limit both ways keeps the memory of its first pass.
  for (int round = 0; round < 20; ++round) {
    void* whole = f.alloc.allocate(100_MiB, f.s1);
    f.alloc.free(whole);
    void* a = f.alloc.allocate(24_MiB, f.s1);
    void* b = f.alloc.allocate(48_MiB, f.s1);
    void* d = f.alloc.allocate(6_MiB, f.s1);
    for (void* p : {a, b, d}) f.alloc.free(p);
  }
  CHECK(reserved(f) == reserved_before);
  f.check_consistent();
}

TEST_CASE("expandable: peer access covers chunks mapped before and after it is allowed", "[expandable]") {
  sim_fixture f(vmm_device());
  void* before = f.alloc.allocate(3_MiB, f.s1);
  CHECK_FALSE(f.sim.peer_allowed(before, 1));
  f.alloc.allow_peer_access(1);
  f.alloc.allow_peer_access(1);  // a second call changes nothing
  f.alloc.allow_peer_access(0);  // the allocator's own device needs no grant
  CHECK(f.sim.peer_allowed(before, 1));
  CHECK(f.sim.peer_allowed(static_cast<char*>(before) + 3_MiB - 1, 1));
  CHECK_FALSE(f.sim.peer_allowed(before, 2));
  void* after = f.alloc.allocate(8_MiB, f.s1);
  void* small = f.alloc.allocate(4_KiB, f.s1);
  CHECK(f.sim.peer_allowed(after, 1));
  CHECK(f.sim.peer_allowed(static_cast<char*>(after) + 8_MiB - 1, 1));
  CHECK(f.sim.peer_allowed(small, 1));
  f.check_consistent();

  // Chunks unmapped by empty_cache and mapped again are opened again.
  f.alloc.free(after);
  f.alloc.empty_cache();
  void* again = f.alloc.allocate(8_MiB, f.s1);
  CHECK(f.sim.peer_allowed(again, 1));
  for (void* p : {before, again, small}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: a refused peer grant is an error and leaves nothing half mapped", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  void* live = f.alloc.allocate(3_MiB, f.s1);
  // The grant of the mapped chunks fails: the peer is not remembered.
  f.sim.fail_nth(sim_fault_point::vm_allow_peer, 1, status_code::device_error);
  CHECK_THROWS_AS(f.alloc.allow_peer_access(1), device_failure);
  void* later = f.alloc.allocate(4_MiB, f.s1);
  CHECK_FALSE(f.sim.peer_allowed(later, 1));

  // A grant that fails while new chunks are mapped undoes that growth.
  f.alloc.allow_peer_access(1);
  const std::size_t mapped = f.sim.mapped_chunks();
  f.sim.fail_nth(sim_fault_point::vm_allow_peer, 2, status_code::device_error);
  CHECK_THROWS_AS(f.alloc.allocate(16_MiB, f.s1), device_failure);
  CHECK(f.sim.mapped_chunks() == mapped);
  f.check_consistent();
  void* retry = f.alloc.allocate(16_MiB, f.s1);
  CHECK(f.sim.peer_allowed(retry, 1));
  for (void* p : {live, later, retry}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("expandable: peer access needs no grant with plain segments", "[expandable]") {
  allocator_config plain;
  plain.expandable_segments = false;
  sim_fixture f(vmm_device(), plain);
  void* p = f.alloc.allocate(3_MiB, f.s1);
  CHECK_NOTHROW(f.alloc.allow_peer_access(1));
  CHECK(f.sim.counters().vm_maps == 0);
  f.alloc.free(p);
}

TEST_CASE("expandable: a block freed on one stream serves another after an event wait", "[expandable]") {
  sim_fixture f(vmm_device(80_GiB, /*manual_events=*/true));
  void* p = f.alloc.allocate(6_MiB, f.s1);
  f.alloc.free(p);
  void* q = f.alloc.allocate(6_MiB, f.s2);
  CHECK(q == p);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  CHECK(f.stats().num_chunk_maps == 3);
  f.check_consistent();
  f.alloc.free(q);
}

// --- device faults in the virtual-memory operations ---

TEST_CASE("expandable fault: chunk creation fails once, the ladder retries", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  f.sim.fail_nth(sim_fault_point::vm_create, 2);  // the second chunk of the first growth
  void* p = f.alloc.allocate(5_MiB, f.s1);
  f.check_consistent();
  CHECK(f.sim.live_chunks() == 3);
  CHECK(f.stats().num_alloc_retries == 1);
  f.alloc.free(p);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
}

TEST_CASE("expandable fault: chunk creation always fails", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  f.sim.fail_always(sim_fault_point::vm_create);
  REQUIRE_THROWS_AS(f.alloc.allocate(5_MiB, f.s1), out_of_memory);
  f.check_consistent();
  CHECK(f.sim.live_chunks() == 0);
  f.sim.fail_always(sim_fault_point::vm_create, status_code::device_error);
  REQUIRE_THROWS_AS(f.alloc.allocate(5_MiB, f.s1), device_failure);
  f.check_consistent();
  CHECK(f.sim.live_chunks() == 0);
  f.sim.clear_faults();
  void* p = f.alloc.allocate(5_MiB, f.s1);
  f.check_consistent();
  f.alloc.free(p);
}

TEST_CASE("expandable fault: mapping fails part-way through a growth", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  f.sim.fail_nth(sim_fault_point::vm_map, 2);
  void* p = f.alloc.allocate(5_MiB, f.s1);  // 3 chunks: the second map fails, the retry succeeds
  f.check_consistent();
  CHECK(f.sim.live_chunks() == 3);
  CHECK(f.sim.mapped_chunks() == 3);
  f.sim.fail_always(sim_fault_point::vm_map, status_code::device_error);
  REQUIRE_THROWS_AS(f.alloc.allocate(50_MiB, f.s1), device_failure);
  f.check_consistent();
  CHECK(f.sim.live_chunks() == 3);  // the new chunks went back to the device
  f.sim.fail_always(sim_fault_point::vm_map);
  REQUIRE_THROWS_AS(f.alloc.allocate(50_MiB, f.s1), out_of_memory);
  f.check_consistent();
  f.sim.clear_faults();
  f.alloc.free(p);
}

TEST_CASE("expandable fault: reserving a range fails", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  f.sim.fail_always(sim_fault_point::vm_reserve);
  REQUIRE_THROWS_AS(f.alloc.allocate(4_MiB, f.s1), out_of_memory);
  f.check_consistent();
  CHECK(f.sim.live_ranges() == 0);
  f.sim.clear_faults();
  void* p = f.alloc.allocate(4_MiB, f.s1);
  f.check_consistent();
  f.alloc.free(p);
}

TEST_CASE("expandable: a range reserves four times the device's memory of address space", "[expandable]") {
  // Note [address space]
  sim_fixture f(vmm_device(8_GiB));
  void* p = f.alloc.allocate(4_MiB, f.s1);
  CHECK(f.sim.live_ranges() == 1);
  CHECK(f.sim.reserved_address_bytes() == caching_allocator::k_address_space_per_device_memory * 8_GiB);
  CHECK(reserved(f) == static_cast<std::int64_t>(4_MiB));
  f.alloc.free(p);
}

TEST_CASE("expandable fault: a driver short of address space gets ranges the size of the device",
          "[expandable][fault]") {
  sim_fixture f(vmm_device(8_GiB));
  const status_code refusal = GENERATE(status_code::out_of_memory, status_code::device_error);
  f.sim.fail_nth(sim_fault_point::vm_reserve, 1, refusal);
  void* large = f.alloc.allocate(4_MiB, f.s1);
  CHECK(f.sim.reserved_address_bytes() == 8_GiB);
  void* small = f.alloc.allocate(4_KiB, f.s1);  // the small range: device-sized from the start
  CHECK(f.sim.live_ranges() == 2);
  CHECK(f.sim.reserved_address_bytes() == 16_GiB);
  f.check_consistent();
  f.alloc.free(large);
  f.alloc.free(small);
}

TEST_CASE("expandable fault: unmapping fails during stitching and empty_cache", "[expandable][fault]") {
  sim_fixture f(vmm_device());
  const std::vector<void*> kept = make_two_holes(f, f.s1);
  f.sim.fail_always(sim_fault_point::vm_unmap, status_code::device_error);
  void* big = f.alloc.allocate(8_MiB, f.s1);  // no chunk moves: the range grows
  f.check_consistent();
  CHECK(f.stats().num_stitched_blocks == 0);
  CHECK(reserved(f) == static_cast<std::int64_t>(20_MiB));
  f.alloc.free(big);
  f.alloc.empty_cache();  // nothing can be unmapped; the books still balance
  f.check_consistent();
  CHECK(reserved(f) == static_cast<std::int64_t>(20_MiB));
  f.sim.fail_nth(sim_fault_point::vm_unmap, 2, status_code::device_error);
  f.alloc.empty_cache();
  f.check_consistent();
  f.sim.clear_faults();
  for (void* p : kept) f.alloc.free(p);
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(f.sim.used_bytes() == 0);
}
