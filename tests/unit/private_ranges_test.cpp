// Private pools with expandable ranges (Note [private ranges]): off by
// default, on with expandable_private_pools (which torch's
// expandable_segments key sets); one range per pool and stream, grown by
// torch's segment sizes, leaving torch's layouts; checkpoints restored after a range grew; the
// chunks kept while the pool is in use and returned once it is released.
// The layouts asserted are those torch 2.11's allocator gave with
// expandable_segments:True on the H200 (bench/RESULTS.md, forty-third
// session).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

allocator_config private_ranges() {
  allocator_config c;
  c.expandable_private_pools = true;
  return c;
}

// (size, allocated) of each block of each of `pool`'s snapshot segments.
using layout = std::vector<std::vector<std::pair<std::size_t, bool>>>;

layout pool_layout(const sim_fixture& f, pool_id pool) {
  layout out;
  for (const segment_info& s : f.snapshot().segments) {
    if (s.pool != pool) continue;
    out.emplace_back();
    for (const block_info& b : s.blocks) out.back().emplace_back(b.size, b.state == block_state::active_allocated);
  }
  std::sort(out.begin(), out.end());  // whatever addresses the ranges got
  return out;
}

void route(sim_fixture& f, pool_id pool, stream_handle stream) {
  f.alloc.begin_allocate_to_pool(pool, [stream](stream_handle s) { return s == stream; });
}

}  // namespace

TEST_CASE("private ranges: off by default, on with expandable_private_pools or torch's key", "[private_pool][expandable]") {
  for (const auto& [config, expandable] :
       {std::pair{allocator_config{}, false}, std::pair{private_ranges(), true},
        std::pair{allocator_config::parse(allocator_config::split_torch_settings("expandable_segments:True").applied),
                  true}}) {
    sim_fixture f(vmm_device(), config);
    void* outside = f.alloc.allocate(3_MiB, f.s2);
    route(f, 5, f.s1);
    void* captured = f.alloc.allocate(3_MiB, f.s1);
    f.alloc.end_allocate_to_pool(5);
    f.check_consistent();
    const allocator_snapshot snap = f.snapshot();
    CHECK(find_segment(snap, addr(outside))->is_expandable);
    CHECK(find_segment(snap, addr(captured))->is_expandable == expandable);
    CHECK(find_segment(snap, addr(captured))->pool == 5);
    f.alloc.free(captured);
    f.alloc.release_pool(5);
    f.alloc.free(outside);
    f.check_consistent();
  }
}

TEST_CASE("private ranges: a plain device, a no_split pool and expandable_segments:False keep plain segments",
          "[private_pool][expandable]") {
  allocator_config off = private_ranges();
  off.expandable_segments = false;
  for (const auto& [device, config, no_split] : {std::tuple{plain_device(), private_ranges(), false},
                                                 std::tuple{vmm_device(), off, false},
                                                 std::tuple{vmm_device(), private_ranges(), true}}) {
    sim_fixture f(device, config);
    f.alloc.create_or_incref_pool(6);
    f.alloc.set_pool_no_split(6, no_split);
    route(f, 6, f.s1);
    void* p = f.alloc.allocate(3_MiB, f.s1);
    f.alloc.end_allocate_to_pool(6);
    CHECK_FALSE(find_segment(f.snapshot(), addr(p))->is_expandable);
    f.alloc.free(p);
    f.alloc.release_pool(6);
    f.alloc.release_pool(6);
    f.check_consistent();
  }
}

TEST_CASE("private ranges: one range per stream, grown by torch's segment sizes", "[private_pool][expandable]") {
  sim_fixture f(vmm_device(), private_ranges());
  route(f, 7, f.s1);
  // A large request below 10 MiB maps 20 MiB, a small one 2 MiB.
  void* a = f.alloc.allocate(2_MiB, f.s1);
  void* tiny = f.alloc.allocate(512, f.s1);
  CHECK(pool_layout(f, 7) == layout{{{512, true}, {2_MiB - 512, false}}, {{2_MiB, true}, {18_MiB, false}}});
  // 12 MiB more: the free 18 MiB serves it in place.
  void* b = f.alloc.allocate(12_MiB, f.s1);
  // 12 MiB again: 6 MiB free at the end, 20 MiB more mapped, one run.
  void* c = f.alloc.allocate(12_MiB, f.s1);
  CHECK(pool_layout(f, 7) == layout{{{512, true}, {2_MiB - 512, false}},
                                    {{2_MiB, true}, {12_MiB, true}, {12_MiB, true}, {14_MiB, false}}});
  CHECK(large_pool(f.stats().reserved_bytes) == static_cast<std::int64_t>(40_MiB));
  f.alloc.end_allocate_to_pool(7);
  // Another stream's captures grow a range of their own.
  route(f, 7, f.s2);
  void* d = f.alloc.allocate(4_MiB, f.s2);
  f.alloc.end_allocate_to_pool(7);
  CHECK(pool_layout(f, 7).size() == 3);
  CHECK(find_segment(f.snapshot(), addr(d))->stream == f.s2);
  CHECK(find_segment(f.snapshot(), addr(a))->stream == f.s1);
  f.check_consistent();
  for (void* p : {a, tiny, b, c, d}) f.alloc.free(p);
  f.alloc.release_pool(7);
  f.check_consistent();
}

TEST_CASE("private ranges: torch's capture sequence leaves torch's pool layout", "[private_pool][expandable]") {
  // torch's test_graph_memory_stats sequence in a capture: b = a.clone(),
  // then five times b = b.clone() + 1 (the clone freed after the add, the
  // old b after that). With expandable_segments:True torch 2.11 left the
  // pool as 2N free, the live N, the rest free, in a range of `mapped`
  // bytes (bench/RESULTS.md, forty-third session, on the H200).
  const struct {
    std::size_t bytes;
    std::size_t mapped;
  } cases[] = {{512, 2_MiB},          {1_MiB, 4_MiB},           {1_MiB + 512, 20_MiB}, {2_MiB, 20_MiB},
               {10_MiB - 512, 40_MiB}, {10_MiB + 512, 40_MiB}, {32_MiB, 100_MiB}};
  for (const auto& c : cases) {
    CAPTURE(c.bytes);
    sim_fixture f(vmm_device(), private_ranges());
    void* a = f.alloc.allocate(c.bytes, f.s1);
    route(f, 3, f.s1);
    void* b = f.alloc.allocate(c.bytes, f.s1);
    for (int step = 0; step < 5; ++step) {
      void* cloned = f.alloc.allocate(c.bytes, f.s1);
      void* added = f.alloc.allocate(c.bytes, f.s1);
      f.alloc.free(cloned);
      f.alloc.free(b);
      b = added;
    }
    f.alloc.end_allocate_to_pool(3);
    const std::size_t n = c.bytes;  // a multiple of 512 already
    CHECK(pool_layout(f, 3) == layout{{{2 * n, false}, {n, true}, {c.mapped - 3 * n, false}}});
    f.check_consistent();
    f.alloc.free(b);
    f.alloc.free(a);
    f.alloc.release_pool(3);
  }
}

TEST_CASE("private ranges: a checkpoint restored after its range grew", "[private_pool][expandable]") {
  // The sequence of torch's test_expandable_segment_checkpoint_growth.
  sim_fixture f(vmm_device(), private_ranges());
  const pool_id pool = 8;
  f.alloc.create_or_incref_pool(pool);
  const pool_checkpoint empty = f.alloc.checkpoint_pool(pool);
  route(f, pool, f.s1);
  void* small = f.alloc.allocate(2_MiB, f.s1);
  f.alloc.end_allocate_to_pool(pool);
  CHECK(pool_layout(f, pool) == layout{{{2_MiB, true}, {18_MiB, false}}});
  const pool_checkpoint with_small = f.alloc.checkpoint_pool(pool);

  pool_restore_result r = f.alloc.restore_pool(empty);
  CHECK(r.freed == std::vector<void*>{small});
  CHECK(r.allocated.empty());
  f.check_consistent();
  route(f, pool, f.s1);
  void* large = f.alloc.allocate(32_MiB, f.s1);
  f.alloc.end_allocate_to_pool(pool);
  CHECK(pool_layout(f, pool) == layout{{{32_MiB, true}, {8_MiB, false}}});
  CHECK(large == small);  // it starts where the range starts

  r = f.alloc.restore_pool(with_small);
  f.check_consistent();
  CHECK(r.freed == std::vector<void*>{large});
  CHECK(r.allocated == std::vector<void*>{small});
  // The chunks mapped since stay, free, one block with the recorded free one.
  CHECK(pool_layout(f, pool) == layout{{{2_MiB, true}, {38_MiB, false}}});
  CHECK(large_pool(f.stats().reserved_bytes) == static_cast<std::int64_t>(40_MiB));
  f.alloc.free(small);
  for (int use = 0; use < 3; ++use) f.alloc.release_pool(pool);  // two captures', create_or_incref_pool's
  CHECK(f.alloc.pool_use_count(pool) == 0);
  f.alloc.empty_cache();
  CHECK(f.sim.live_ranges() == 0);
  f.check_consistent();
}

TEST_CASE("private ranges: chunks stay while the pool is in use and go back once it is released",
          "[private_pool][expandable]") {
  sim_fixture f(vmm_device(), private_ranges());
  const pool_id pool = 9;
  route(f, pool, f.s1);
  void* a = f.alloc.allocate(30_MiB, f.s1);
  void* b = f.alloc.allocate(8_MiB, f.s1);
  f.alloc.end_allocate_to_pool(pool);
  f.alloc.free(a);
  const std::int64_t reserved = all(f.stats().reserved_bytes);
  f.alloc.empty_cache();
  f.alloc.empty_cache(pool);
  CHECK(all(f.stats().reserved_bytes) == reserved);  // in use: a graph may replay into it
  f.alloc.release_pool(pool);
  f.alloc.empty_cache(pool);
  // Only the chunks under b remain.
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(8_MiB));
  CHECK(f.alloc.pool_use_count(pool) == 0);
  f.check_consistent();
  f.alloc.free(b);
  f.alloc.empty_cache();
  CHECK(all(f.stats().reserved_bytes) == 0);
  CHECK(f.sim.live_ranges() == 0);
  CHECK(pool_layout(f, pool).empty());
  f.check_consistent();
}
