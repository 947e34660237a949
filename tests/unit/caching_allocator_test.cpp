// Deterministic policy tests of caching_allocator on the simulated device:
// rounding, pool and segment sizes, best fit, split thresholds, coalescing,
// oversize blocks, edge sizes, misuse errors and private pools.
#include <cstddef>
#include <cstdint>
#include <limits>

#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::find_block;
using streamalloc::test::find_segment;
using streamalloc::test::large_pool;
using streamalloc::test::manual_events;
using streamalloc::test::sim_fixture;
using streamalloc::test::small_pool;

namespace {

std::size_t segment_size_of(const sim_fixture& f, const void* p) {
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  return seg->total_size;
}

bool in_segment_of(const sim_fixture& f, const void* p, const void* q) {
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  return addr(q) >= seg->address && addr(q) < seg->address + seg->total_size;
}

allocator_config with_max_split(std::size_t max_split_bytes) {
  allocator_config c;
  c.max_split_bytes = max_split_bytes;
  return c;
}

}  // namespace

TEST_CASE("caching_allocator: requests round up to multiples of 512 bytes", "[caching_allocator]") {
  sim_fixture f;
  struct expectation {
    std::size_t requested;
    std::size_t rounded;
  };
  const expectation cases[] = {{1, 512},
                               {100, 512},
                               {511, 512},
                               {512, 512},
                               {513, 1024},
                               {1000, 1024},
                               {4097, 4608},
                               {1_MiB - 1, 1_MiB},
                               {1_MiB, 1_MiB},
                               {1_MiB + 1, 1_MiB + 512},
                               {5_MiB + 3, 5_MiB + 512}};
  for (const expectation& c : cases) {
    CAPTURE(c.requested);
    void* p = f.alloc.allocate(c.requested, f.s1);
    REQUIRE(p != nullptr);
    CHECK(f.alloc.allocation_size(p) == c.rounded);
    const device_stats st = f.stats();
    CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(c.rounded));
    CHECK(all(st.requested_bytes) == static_cast<std::int64_t>(c.requested));
    f.check_consistent();
    f.alloc.free(p);
    f.check_consistent();
  }
}

TEST_CASE("caching_allocator: size 0 returns nullptr and changes nothing", "[caching_allocator]") {
  sim_fixture f;
  void* keep = f.alloc.allocate(4096, f.s1);
  const auto before = f.stats().to_map();
  const sim_counters counters_before = f.sim.counters();
  CHECK(f.alloc.allocate(0, f.s1) == nullptr);
  CHECK(f.alloc.allocate(0, f.s2) == nullptr);
  CHECK(f.stats().to_map() == before);
  CHECK(f.sim.counters().segment_allocs == counters_before.segment_allocs);
  f.check_consistent();
  f.alloc.free(keep);
}

TEST_CASE("caching_allocator: sizes near SIZE_MAX throw out_of_memory without wrapping", "[caching_allocator]") {
  sim_fixture f;
  void* keep = f.alloc.allocate(4096, f.s1);
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  const std::size_t huge_sizes[] = {max, max - 1, max - 511, max - 2_MiB, max / 2 + 1, std::size_t{1} << 62};
  for (std::size_t size : huge_sizes) {
    CAPTURE(size);
    const device_stats before = f.stats();
    REQUIRE_THROWS_AS(f.alloc.allocate(size, f.s1), out_of_memory);
    const device_stats after = f.stats();
    CHECK(all(after.allocated_bytes) == all(before.allocated_bytes));
    CHECK(all(after.allocation) == all(before.allocation));
    CHECK(all(after.reserved_bytes) == all(before.reserved_bytes));
    CHECK(f.sim.live_segments() == 1);
    f.check_consistent();
  }
  try {
    f.alloc.allocate(std::size_t{1} << 62, f.s1);
    FAIL("allocate(2^62) returned");
  } catch (const out_of_memory& e) {
    CHECK(e.context().requested_bytes == (std::size_t{1} << 62));
    CHECK(e.context().device_total_bytes == 80_GiB);
  }
  // The allocator keeps working after refusing.
  void* p = f.alloc.allocate(1_MiB, f.s1);
  REQUIRE(p != nullptr);
  f.alloc.free(p);
  f.alloc.free(keep);
  f.check_consistent();
}

TEST_CASE("caching_allocator: small requests share 2 MiB segments", "[caching_allocator]") {
  sim_fixture f;
  void* a = f.alloc.allocate(1000, f.s1);
  void* b = f.alloc.allocate(4096, f.s1);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  // The only free block is the segment's tail, so b is carved right after a.
  CHECK(addr(b) == addr(a) + 1024);
  CHECK(segment_size_of(f, a) == 2_MiB);
  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].is_small);
  CHECK(snap.segments[0].stream == f.s1);
  CHECK(snap.segments[0].pool == 0);
  const device_stats st = f.stats();
  CHECK(small_pool(st.segment) == 1);
  CHECK(large_pool(st.segment) == 0);
  CHECK(small_pool(st.reserved_bytes) == static_cast<std::int64_t>(2_MiB));
  CHECK(small_pool(st.allocation) == 2);
  CHECK(f.sim.counters().segment_allocs == 1);
  f.check_consistent();

  SECTION("1 MiB is still small: two of them share one segment") {
    void* m1 = f.alloc.allocate(1_MiB, f.s1);  // fits in the rest of a's segment
    CHECK(addr(m1) == addr(b) + 4096);
    void* m2 = f.alloc.allocate(1_MiB, f.s1);  // less than 1 MiB is left there
    CHECK_FALSE(in_segment_of(f, a, m2));
    CHECK(segment_size_of(f, m2) == 2_MiB);
    void* m3 = f.alloc.allocate(1_MiB, f.s1);
    CHECK(addr(m3) == addr(m2) + 1_MiB);
    void* m4 = f.alloc.allocate(1_MiB, f.s1);
    CHECK_FALSE(in_segment_of(f, m2, m4));
    CHECK_FALSE(in_segment_of(f, a, m4));
    CHECK(small_pool(f.stats().segment) == 3);
    CHECK(large_pool(f.stats().segment) == 0);
    f.check_consistent();
    for (void* p : {m1, m2, m3, m4}) f.alloc.free(p);
  }
  f.alloc.free(a);
  f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("caching_allocator: large pool segment sizes", "[caching_allocator]") {
  sim_fixture f;
  SECTION("just over 1 MiB takes a 20 MiB large segment") {
    void* p = f.alloc.allocate(1_MiB + 1, f.s1);
    CHECK(segment_size_of(f, p) == 20_MiB);
    CHECK(f.alloc.allocation_size(p) == 1_MiB + 512);
    CHECK(large_pool(f.stats().segment) == 1);
    CHECK(small_pool(f.stats().segment) == 0);
    f.check_consistent();
  }
  SECTION("9 MiB takes a 20 MiB segment, and two of them share it") {
    void* p = f.alloc.allocate(9_MiB, f.s1);
    void* q = f.alloc.allocate(9_MiB, f.s1);
    CHECK(segment_size_of(f, p) == 20_MiB);
    CHECK(addr(q) == addr(p) + 9_MiB);
    void* r = f.alloc.allocate(9_MiB, f.s1);
    CHECK_FALSE(in_segment_of(f, p, r));
    CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(40_MiB));
    f.check_consistent();
  }
  SECTION("10 MiB and up get a segment of their size rounded to 2 MiB") {
    void* p = f.alloc.allocate(10_MiB, f.s1);
    CHECK(segment_size_of(f, p) == 10_MiB);
    CHECK(f.alloc.allocation_size(p) == 10_MiB);
    void* q = f.alloc.allocate(10_MiB + 1, f.s1);
    CHECK(segment_size_of(f, q) == 12_MiB);
    // The remainder (2 MiB - 512) is more than 1 MiB: split.
    CHECK(f.alloc.allocation_size(q) == 10_MiB + 512);
    void* r = f.alloc.allocate(11_MiB, f.s1);
    CHECK(segment_size_of(f, r) == 12_MiB);
    // The remainder is exactly 1 MiB: not split, the block keeps it.
    CHECK(f.alloc.allocation_size(r) == 12_MiB);
    const device_stats st = f.stats();
    CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(10_MiB + 10_MiB + 512 + 12_MiB));
    CHECK(all(st.requested_bytes) == static_cast<std::int64_t>(10_MiB + 10_MiB + 1 + 11_MiB));
    CHECK(all(st.reserved_bytes) == static_cast<std::int64_t>(34_MiB));
    f.check_consistent();
  }
  SECTION("100 MiB + 1 byte gets a 102 MiB segment") {
    void* p = f.alloc.allocate(100_MiB + 1, f.s1);
    CHECK(segment_size_of(f, p) == 102_MiB);
    f.check_consistent();
  }
}

TEST_CASE("caching_allocator: best fit picks the smallest fitting block, lowest address on ties",
          "[caching_allocator]") {
  sim_fixture f;
  // Free holes of 4, 8, 6 and 8 KiB, separated by live 512 B blocks so they
  // cannot coalesce.
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* x1 = f.alloc.allocate(512, f.s1);
  void* b = f.alloc.allocate(8_KiB, f.s1);
  void* x2 = f.alloc.allocate(512, f.s1);
  void* c = f.alloc.allocate(6_KiB, f.s1);
  void* x3 = f.alloc.allocate(512, f.s1);
  void* d = f.alloc.allocate(8_KiB, f.s1);
  void* x4 = f.alloc.allocate(512, f.s1);
  REQUIRE(addr(b) == addr(a) + 4_KiB + 512);
  REQUIRE(addr(c) == addr(b) + 8_KiB + 512);
  REQUIRE(addr(d) == addr(c) + 6_KiB + 512);
  for (void* p : {a, b, c, d}) f.alloc.free(p);
  f.check_consistent();
  CHECK(all(f.stats().inactive_split) == 5);  // four holes and the tail

  void* p5 = f.alloc.allocate(5_KiB, f.s1);
  CHECK(p5 == c);
  void* p8 = f.alloc.allocate(8_KiB, f.s1);
  CHECK(p8 == b);
  void* p4 = f.alloc.allocate(4_KiB, f.s1);
  CHECK(p4 == a);
  void* p8b = f.alloc.allocate(8_KiB, f.s1);
  CHECK(p8b == d);
  // Only the 1 KiB rest of c's hole and the tail are free now.
  void* p6 = f.alloc.allocate(6_KiB, f.s1);
  CHECK(addr(p6) == addr(x4) + 512);
  void* p1 = f.alloc.allocate(1_KiB, f.s1);
  CHECK(addr(p1) == addr(c) + 5_KiB);
  f.check_consistent();
  for (void* p : {p5, p8, p4, p8b, p6, p1, x1, x2, x3, x4}) f.alloc.free(p);
  f.check_consistent();
  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].blocks.size() == 1);
}

TEST_CASE("caching_allocator: split thresholds", "[caching_allocator]") {
  sim_fixture f;
  SECTION("small pool splits off any remainder of at least 512 bytes") {
    void* a = f.alloc.allocate(1024, f.s1);
    void* guard = f.alloc.allocate(512, f.s1);
    f.alloc.free(a);
    void* p = f.alloc.allocate(512, f.s1);
    REQUIRE(p == a);
    CHECK(f.alloc.allocation_size(p) == 512);
    const allocator_snapshot snap = f.snapshot();
    const block_info* rest = find_block(snap, addr(a) + 512);
    REQUIRE(rest != nullptr);
    CHECK(rest->size == 512);
    CHECK(rest->state == block_state::inactive);
    f.check_consistent();
    f.alloc.free(p);
    f.alloc.free(guard);
  }
  SECTION("large pool keeps a remainder of exactly 1 MiB in the block") {
    void* p = f.alloc.allocate(9_MiB, f.s1);
    void* q = f.alloc.allocate(10_MiB, f.s1);  // from the 11 MiB rest of p's segment
    CHECK(addr(q) == addr(p) + 9_MiB);
    CHECK(f.alloc.allocation_size(q) == 11_MiB);
    CHECK(all(f.stats().segment) == 1);
    CHECK(all(f.stats().allocated_bytes) == static_cast<std::int64_t>(20_MiB));
    CHECK(all(f.stats().requested_bytes) == static_cast<std::int64_t>(19_MiB));
    f.check_consistent();
  }
  SECTION("large pool splits a remainder of more than 1 MiB") {
    void* p = f.alloc.allocate(9_MiB, f.s1);
    void* q = f.alloc.allocate(10_MiB - 512, f.s1);
    CHECK(addr(q) == addr(p) + 9_MiB);
    CHECK(f.alloc.allocation_size(q) == 10_MiB - 512);
    const allocator_snapshot snap = f.snapshot();
    const block_info* rest = find_block(snap, addr(q) + 10_MiB - 512);
    REQUIRE(rest != nullptr);
    CHECK(rest->size == 1_MiB + 512);
    CHECK(rest->state == block_state::inactive);
    CHECK(all(f.stats().inactive_split) == 1);
    CHECK(all(f.stats().inactive_split_bytes) == static_cast<std::int64_t>(1_MiB + 512));
    f.check_consistent();
  }
}

TEST_CASE("caching_allocator: freed blocks coalesce with free neighbours", "[caching_allocator]") {
  sim_fixture f;
  void* a = f.alloc.allocate(4_KiB, f.s1);
  void* b = f.alloc.allocate(4_KiB, f.s1);
  void* c = f.alloc.allocate(4_KiB, f.s1);
  void* d = f.alloc.allocate(4_KiB, f.s1);  // keeps c away from the free tail
  REQUIRE(addr(b) == addr(a) + 4_KiB);
  REQUIRE(addr(c) == addr(b) + 4_KiB);
  REQUIRE(addr(d) == addr(c) + 4_KiB);

  const auto free_block_at = [&](void* p) -> std::size_t {
    const allocator_snapshot snap = f.snapshot();
    const block_info* blk = find_block(snap, addr(p));
    REQUIRE(blk != nullptr);
    CHECK(blk->state == block_state::inactive);
    return blk->size;
  };
  SECTION("left neighbour free") {
    f.alloc.free(a);
    f.alloc.free(b);
    CHECK(free_block_at(a) == 8_KiB);
    f.check_consistent();
    f.alloc.free(c);
  }
  SECTION("right neighbour free") {
    f.alloc.free(b);
    f.alloc.free(a);
    CHECK(free_block_at(a) == 8_KiB);
    f.check_consistent();
    f.alloc.free(c);
  }
  SECTION("both neighbours free") {
    f.alloc.free(a);
    f.alloc.free(c);
    CHECK(all(f.stats().inactive_split) == 3);  // a, c and the tail
    f.alloc.free(b);
    CHECK(free_block_at(a) == 12_KiB);
    CHECK(all(f.stats().inactive_split) == 2);
    CHECK(all(f.stats().inactive_split_bytes) == static_cast<std::int64_t>(2_MiB - 4_KiB));
    f.check_consistent();
  }
  f.alloc.free(d);
  // Everything is free: one block covers the segment, which is no longer split.
  CHECK(free_block_at(a) == 2_MiB);
  const device_stats st = f.stats();
  CHECK(all(st.inactive_split) == 0);
  CHECK(all(st.inactive_split_bytes) == 0);
  CHECK(all(st.reserved_bytes) == static_cast<std::int64_t>(2_MiB));
  f.check_consistent();
  void* p = f.alloc.allocate(1_MiB, f.s1);
  CHECK(p == a);
  CHECK(f.sim.counters().segment_allocs == 1);
  f.alloc.free(p);
}

TEST_CASE("caching_allocator: oversize blocks (max_split_bytes)", "[caching_allocator]") {
  sim_fixture f(streamalloc::test::plain_device(), with_max_split(40_MiB));
  CHECK(f.stats().max_split_size == static_cast<std::int64_t>(40_MiB));
  void* big = f.alloc.allocate(80_MiB, f.s1);
  CHECK(segment_size_of(f, big) == 80_MiB);
  CHECK(f.stats().oversize_allocations.current == 1);
  CHECK(f.stats().oversize_segments.current == 1);
  f.alloc.free(big);
  CHECK(f.stats().oversize_allocations.current == 0);
  CHECK(f.stats().oversize_segments.current == 1);
  f.check_consistent();

  SECTION("a cached oversize block serves a slightly smaller request whole, never split") {
    void* p = f.alloc.allocate(70_MiB, f.s1);
    CHECK(p == big);
    CHECK(f.alloc.allocation_size(p) == 80_MiB);
    CHECK(all(f.stats().allocated_bytes) == static_cast<std::int64_t>(80_MiB));
    CHECK(all(f.stats().requested_bytes) == static_cast<std::int64_t>(70_MiB));
    CHECK(f.sim.counters().segment_allocs == 1);
    const allocator_snapshot snap = f.snapshot();
    REQUIRE(snap.segments.size() == 1);
    CHECK(snap.segments[0].blocks.size() == 1);
    f.check_consistent();
    f.alloc.free(p);
  }
  SECTION("a request below max_split never takes an oversize block") {
    void* p = f.alloc.allocate(30_MiB, f.s1);
    CHECK_FALSE(in_segment_of(f, big, p));
    void* q = f.alloc.allocate(4_MiB, f.s1);
    CHECK_FALSE(in_segment_of(f, big, q));
    CHECK(f.sim.counters().segment_allocs == 3);
    CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(80_MiB + 30_MiB + 20_MiB));
    f.check_consistent();
    f.alloc.free(p);
    f.alloc.free(q);
  }
  SECTION("an oversize block is not reused for a request more than 20 MiB smaller") {
    void* p = f.alloc.allocate(50_MiB, f.s1);  // 30 MiB smaller than the cached block
    CHECK_FALSE(in_segment_of(f, big, p));
    CHECK(segment_size_of(f, p) == 50_MiB);
    void* q = f.alloc.allocate(62_MiB, f.s1);  // 18 MiB smaller: reuse
    CHECK(q == big);
    CHECK(f.alloc.allocation_size(q) == 80_MiB);
    f.check_consistent();
    f.alloc.free(p);
    f.alloc.free(q);
  }
  SECTION("a larger request grows a new segment") {
    void* p = f.alloc.allocate(100_MiB, f.s1);
    CHECK_FALSE(in_segment_of(f, big, p));
    CHECK(f.stats().oversize_segments.current == 2);
    f.alloc.free(p);
    f.check_consistent();
  }
  SECTION("best fit among oversize blocks") {
    void* p = f.alloc.allocate(90_MiB, f.s1);
    f.alloc.free(p);
    void* q = f.alloc.allocate(78_MiB, f.s1);
    CHECK(q == big);
    void* r = f.alloc.allocate(78_MiB, f.s1);
    CHECK(r == p);
    f.check_consistent();
    f.alloc.free(q);
    f.alloc.free(r);
  }
  f.check_consistent();
}

TEST_CASE("caching_allocator: max_non_split_rounding_bytes bounds oversize reuse", "[caching_allocator]") {
  allocator_config cfg = with_max_split(40_MiB);
  cfg.max_non_split_rounding_bytes = 4_MiB;
  sim_fixture f(streamalloc::test::plain_device(), cfg);
  void* big = f.alloc.allocate(80_MiB, f.s1);
  f.alloc.free(big);
  void* p = f.alloc.allocate(70_MiB, f.s1);  // 10 MiB smaller than the cached block
  CHECK_FALSE(in_segment_of(f, big, p));
  void* q = f.alloc.allocate(78_MiB, f.s1);  // 2 MiB smaller: reuse
  CHECK(q == big);
  f.check_consistent();
  f.alloc.free(p);
  f.alloc.free(q);
}

TEST_CASE("caching_allocator: unlimited max_split reports -1", "[caching_allocator]") {
  sim_fixture f;
  CHECK(f.stats().max_split_size == -1);
  // Without a limit even a huge cached block is split for a small request.
  void* p = f.alloc.allocate(200_MiB, f.s1);
  f.alloc.free(p);
  void* q = f.alloc.allocate(30_MiB, f.s1);
  CHECK(q == p);
  CHECK(f.alloc.allocation_size(q) == 30_MiB);
  CHECK(f.sim.counters().segment_allocs == 1);
  f.check_consistent();
  f.alloc.free(q);
}

TEST_CASE("caching_allocator: misuse throws usage_error and changes nothing", "[caching_allocator]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(4_KiB, f.s1);
  void* big = f.alloc.allocate(30_MiB, f.s2);
  void* gone = f.alloc.allocate(8_KiB, f.s1);
  f.alloc.free(gone);
  const auto before = f.stats().to_map();
  const sim_counters counters_before = f.sim.counters();
  const std::size_t pending_before = f.sim.pending_events().size();
  int local = 0;

  const auto unchanged = [&] {
    CHECK(f.stats().to_map() == before);
    CHECK(f.sim.counters().event_records == counters_before.event_records);
    CHECK(f.sim.counters().segment_allocs == counters_before.segment_allocs);
    CHECK(f.sim.counters().segment_frees == counters_before.segment_frees);
    CHECK(f.sim.pending_events().size() == pending_before);
    f.check_consistent();
  };
  SECTION("free of a pointer never allocated") {
    REQUIRE_THROWS_AS(f.alloc.free(&local), usage_error);
    unchanged();
  }
  SECTION("free of an interior pointer") {
    REQUIRE_THROWS_AS(f.alloc.free(static_cast<char*>(p) + 512), usage_error);
    REQUIRE_THROWS_AS(f.alloc.free(static_cast<char*>(big) + 1), usage_error);
    unchanged();
  }
  SECTION("double free") {
    REQUIRE_THROWS_AS(f.alloc.free(gone), usage_error);
    unchanged();
  }
  SECTION("double free of a pending block") {
    f.alloc.record_stream(p, f.s3);
    f.alloc.free(p);
    const auto pending_map = f.stats().to_map();
    REQUIRE_THROWS_AS(f.alloc.free(p), usage_error);
    REQUIRE_THROWS_AS(f.alloc.record_stream(p, f.s2), usage_error);
    CHECK(f.stats().to_map() == pending_map);
    f.check_consistent();
    f.sim.complete_all_events();
    p = nullptr;
  }
  SECTION("record_stream of unknown, interior and freed pointers") {
    REQUIRE_THROWS_AS(f.alloc.record_stream(&local, f.s2), usage_error);
    REQUIRE_THROWS_AS(f.alloc.record_stream(static_cast<char*>(p) + 512, f.s2), usage_error);
    REQUIRE_THROWS_AS(f.alloc.record_stream(gone, f.s2), usage_error);
    unchanged();
    // None of them left a stream use behind on p: its free records nothing.
    f.alloc.free(p);
    CHECK(f.sim.counters().event_records == counters_before.event_records);
    p = nullptr;
  }
  SECTION("allocation_size and owns of unknown pointers") {
    REQUIRE_THROWS_AS(f.alloc.allocation_size(&local), usage_error);
    REQUIRE_THROWS_AS(f.alloc.allocation_size(gone), usage_error);
    REQUIRE_THROWS_AS(f.alloc.allocation_size(static_cast<char*>(p) + 512), usage_error);
    CHECK_FALSE(f.alloc.owns(&local));
    CHECK_FALSE(f.alloc.owns(gone));
    CHECK_FALSE(f.alloc.owns(static_cast<char*>(p) + 512));
    CHECK(f.alloc.owns(p));
    CHECK(f.alloc.owns(big));
    unchanged();
  }
  SECTION("bad memory fractions (0 is allowed, as in torch)") {
    for (double bad : {-0.5, -0.0001, 1.5, std::numeric_limits<double>::quiet_NaN(),
                       std::numeric_limits<double>::infinity()}) {
      CAPTURE(bad);
      REQUIRE_THROWS_AS(f.alloc.set_memory_fraction(bad), usage_error);
      CHECK(f.alloc.memory_fraction() == 1.0);
    }
    unchanged();
  }
  if (p != nullptr) f.alloc.free(p);
  f.alloc.free(big);
  f.check_consistent();
}

TEST_CASE("caching_allocator: record_stream on the block's own stream is a no-op", "[caching_allocator]") {
  sim_fixture f(manual_events());
  void* p = f.alloc.allocate(4_KiB, f.s1);
  const std::size_t records = f.sim.counters().event_records;
  f.alloc.record_stream(p, f.s1);
  f.alloc.free(p);
  CHECK(f.sim.counters().event_records == records);
  CHECK(f.sim.pending_events().empty());
  const allocator_snapshot snap = f.snapshot();
  const block_info* blk = find_block(snap, addr(p));
  REQUIRE(blk != nullptr);
  CHECK(blk->state == block_state::inactive);
  CHECK(all(f.stats().active) == 0);
  f.check_consistent();
  // Immediately reusable on its stream.
  CHECK(f.alloc.allocate(4_KiB, f.s1) == p);
  f.alloc.free(p);
}

TEST_CASE("caching_allocator: private pools keep their segments apart", "[caching_allocator]") {
  allocator_config cfg;
  cfg.cross_stream_reuse = false;  // keeps s2 out of s1's cached segment
  sim_fixture f(streamalloc::test::plain_device(), cfg);
  const pool_id pool = 7;
  void* outside = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.free(outside);  // cached in the default pool

  f.alloc.begin_allocate_to_pool(pool, [&](stream_handle s) { return s == f.s1; });
  void* in_pool = f.alloc.allocate(4_KiB, f.s1);
  void* not_routed = f.alloc.allocate(4_KiB, f.s2);
  CHECK_FALSE(in_segment_of(f, outside, in_pool));
  {
    const allocator_snapshot snap = f.snapshot();
    const segment_info* seg = find_segment(snap, addr(in_pool));
    REQUIRE(seg != nullptr);
    CHECK(seg->pool == pool);
    const segment_info* other = find_segment(snap, addr(not_routed));
    REQUIRE(other != nullptr);
    CHECK(other->pool == 0);
  }
  f.check_consistent();
  f.alloc.end_allocate_to_pool(pool);

  // The pool's free memory is not used by default-pool allocations...
  f.alloc.free(in_pool);
  void* after = f.alloc.allocate(4_KiB, f.s1);
  CHECK_FALSE(in_segment_of(f, in_pool, after));
  CHECK(after == outside);
  // ...and it stays cached for the pool.
  const std::int64_t reserved = all(f.stats().reserved_bytes);
  CHECK(reserved == static_cast<std::int64_t>(3 * 2_MiB));
  f.check_consistent();

  SECTION("every begin counts a use; the memory returns once the last use is released, the blocks are freed and the cache "
          "is emptied") {
    f.alloc.begin_allocate_to_pool(pool, [&](stream_handle s) { return s == f.s1; });
    void* again = f.alloc.allocate(4_KiB, f.s1);
    CHECK(in_segment_of(f, in_pool, again));  // reuses the pool's own cache
    f.alloc.end_allocate_to_pool(pool);
    f.alloc.release_pool(pool);  // one use left
    f.alloc.free(again);
    CHECK(all(f.stats().reserved_bytes) == reserved);
    f.check_consistent();
    void* held = nullptr;
    f.alloc.begin_allocate_to_pool(pool, [&](stream_handle s) { return s == f.s1; });
    held = f.alloc.allocate(4_KiB, f.s1);
    f.alloc.end_allocate_to_pool(pool);
    f.alloc.release_pool(pool);
    f.alloc.release_pool(pool);  // no use left, but a block is live
    CHECK(f.alloc.pool_use_count(pool) == 0);
    f.alloc.empty_cache();
    CHECK(all(f.stats().reserved_bytes) == reserved);
    f.alloc.free(held);
    // Note [released pools]: the emptied segment stays cached, as in torch...
    CHECK(all(f.stats().reserved_bytes) == reserved);
    f.check_consistent();
    // ...until the cache is emptied.
    f.alloc.empty_cache();
    CHECK(all(f.stats().reserved_bytes) == reserved - static_cast<std::int64_t>(2_MiB));
    CHECK(f.sim.live_segments() == 2);
    CHECK(f.alloc.pool_use_count(pool) == 0);
    f.check_consistent();
  }
  SECTION("release_pool keeps the pool's cache until empty_cache(pool), as torch does") {
    f.alloc.release_pool(pool);
    CHECK(all(f.stats().reserved_bytes) == reserved);
    CHECK(f.sim.live_segments() == 3);
    f.check_consistent();
    f.alloc.empty_cache(pool);
    CHECK(all(f.stats().reserved_bytes) == reserved - static_cast<std::int64_t>(2_MiB));
    CHECK(f.sim.live_segments() == 2);
    f.check_consistent();
  }
  f.alloc.free(after);
  f.alloc.free(not_routed);
  f.check_consistent();
}

TEST_CASE("caching_allocator: empty_cache keeps the cache of a private pool still in use", "[caching_allocator]") {
  // A graph replays into the addresses its capture allocated, so a pool's
  // free blocks stay reserved until release_pool drops its last use.
  sim_fixture f;
  f.alloc.begin_allocate_to_pool(9, [&](stream_handle s) { return s == f.s1; });
  void* p = f.alloc.allocate(4_KiB, f.s1);
  f.alloc.end_allocate_to_pool(9);
  f.alloc.free(p);
  void* q = f.alloc.allocate(4_KiB, f.s2);
  f.alloc.free(q);  // a default-pool segment with nothing live
  f.alloc.empty_cache();
  const allocator_snapshot snap = f.snapshot();
  REQUIRE(snap.segments.size() == 1);
  CHECK(snap.segments[0].pool == 9);
  f.check_consistent();
  f.alloc.release_pool(9);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}
