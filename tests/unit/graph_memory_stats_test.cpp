// The sequence of PyTorch's test_graph_memory_stats_and_use_result_after_
// destroy_graph (test/test_cuda.py) on the simulated device with expandable
// segments, streamalloc's default: an input tensor in the default pool, the
// two RNG holders a CUDA graph allocates in the default pool when its
// capture begins, six tensors of the input's size captured into the graph's
// private pool, then the graph destroyed. The statistics moved by each step
// must be those torch's own allocator (plain segments) shows, which its test
// asserts for streamalloc too: Note [mid-size requests].
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

// Deltas of the pool the test checks: segments, reserved bytes, active
// blocks, active bytes.
struct deltas {
  std::int64_t segments;
  std::int64_t reserved;
  std::int64_t active;
  std::int64_t active_bytes;
};

struct graph_case {
  std::size_t bytes;        // the input's size (numel * 4 in torch's test)
  bool small;               // which pool torch's test checks
  deltas after_capture;     // stats after the capture minus before it
  deltas after_graph_gone;  // after the graph is destroyed and the cache emptied
};

deltas deltas_between(const device_stats& before, const device_stats& after, bool small) {
  const auto pool = [small](const stat_array& a) { return small ? small_pool(a) : large_pool(a); };
  return {pool(after.segment) - pool(before.segment), pool(after.reserved_bytes) - pool(before.reserved_bytes),
          pool(after.active) - pool(before.active), pool(after.active_bytes) - pool(before.active_bytes)};
}

void check_deltas(const deltas& have, const deltas& want, const std::string& when) {
  INFO(when);
  CHECK(have.segments == want.segments);
  CHECK(have.reserved == want.reserved);
  CHECK(have.active == want.active);
  CHECK(have.active_bytes == want.active_bytes);
}

constexpr std::int64_t i64(std::size_t v) { return static_cast<std::int64_t>(v); }

}  // namespace

TEST_CASE("graph memory stats: torch's deltas for inputs from 512 B to 10 MiB + 512", "[private_pool][stats]") {
  // torch's kSmallBuffer 2 MiB, kLargeBuffer 20 MiB; a request of 10 MiB or
  // more gets a segment of its own rounded up to 2 MiB (12 MiB here). In the
  // small cases the graph's two 8-byte RNG holders (512 bytes each) count as
  // active too.
  const graph_case cases[] = {
      {512, true, {1, i64(2_MiB), 3, 512 + 1024}, {1, i64(2_MiB), 1, 512}},
      {1_MiB, true, {2, i64(4_MiB), 3, i64(1_MiB) + 1024}, {1, i64(2_MiB), 1, i64(1_MiB)}},
      {1_MiB + 512, false, {1, i64(20_MiB), 1, i64(1_MiB + 512)}, {1, i64(20_MiB), 1, i64(1_MiB + 512)}},
      {10_MiB - 512, false, {2, i64(40_MiB), 1, i64(10_MiB - 512)}, {1, i64(20_MiB), 1, i64(10_MiB - 512)}},
      {10_MiB + 512, false, {3, i64(36_MiB), 1, i64(10_MiB + 512)}, {1, i64(12_MiB), 1, i64(10_MiB + 512)}},
  };
  // One allocator for all cases, as torch's test runs them in one process.
  sim_fixture f(vmm_device());
  const stream_handle s = f.s1;  // the side stream the test captures on
  pool_id graph_pool = 1;
  for (const graph_case& c : cases) {
    CAPTURE(c.bytes);
    void* a = f.alloc.allocate(c.bytes, s);
    const device_stats before = f.stats();

    // CUDAGraph.capture_begin: the RNG seed and offset holders come from the
    // default pool before allocation to the private pool begins.
    void* seed = f.alloc.allocate(8, s);
    void* offset = f.alloc.allocate(8, s);
    f.alloc.begin_allocate_to_pool(graph_pool, [s](stream_handle stream) { return stream == s; });
    void* b = f.alloc.allocate(c.bytes, s);  // b = a.clone()
    for (int i = 0; i < 5; ++i) {            // b = b.clone() + 1
      void* copy = f.alloc.allocate(c.bytes, s);
      void* sum = f.alloc.allocate(c.bytes, s);
      f.alloc.free(copy);
      f.alloc.free(b);
      b = sum;
    }
    f.alloc.end_allocate_to_pool(graph_pool);
    f.check_consistent();
    check_deltas(deltas_between(before, f.stats(), c.small), c.after_capture, "after the capture");
    // The test checks again after an empty_cache while the graph lives.
    f.alloc.empty_cache();
    check_deltas(deltas_between(before, f.stats(), c.small), c.after_capture, "after empty_cache, graph alive");

    // del g: the holders go, the pool is released, the cache emptied; b
    // stays, in the released pool's segment.
    f.alloc.free(seed);
    f.alloc.free(offset);
    f.alloc.release_pool(graph_pool);
    f.alloc.empty_cache();
    f.check_consistent();
    check_deltas(deltas_between(before, f.stats(), c.small), c.after_graph_gone, "after the graph is destroyed");

    f.alloc.free(a);
    f.alloc.free(b);
    f.alloc.empty_cache();
    CHECK(all(f.stats().reserved_bytes) == 0);
    ++graph_pool;
  }
}

namespace {

// A 1 MiB input and the two 8-byte RNG holders on stream s1: all three in
// one small chunk (of `chunk` bytes), the only one mapped.
void check_input_shares_small_chunk_with_holders(sim_fixture& f, std::size_t chunk = 2_MiB) {
  void* a = f.alloc.allocate(1_MiB, f.s1);
  void* seed = f.alloc.allocate(8, f.s1);
  void* offset = f.alloc.allocate(8, f.s1);
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(a));
  REQUIRE(seg != nullptr);
  CHECK(seg->is_small);
  CHECK(find_segment(snap, addr(seed)) == seg);
  CHECK(find_segment(snap, addr(offset)) == seg);
  CHECK(small_pool(f.stats().segment) == 1);
  CHECK(small_pool(f.stats().reserved_bytes) == i64(chunk));
  f.check_consistent();
  for (void* p : {a, seed, offset}) f.alloc.free(p);
  f.check_consistent();
}

}  // namespace

TEST_CASE("graph memory stats: a 1 MiB input shares its small chunk with the RNG holders", "[private_pool][stats]") {
  // The case that differed from torch: a 1 MiB request of a stream without
  // a free small block opens a small chunk, as torch's small pool would,
  // and the holders fit beside it instead of mapping a chunk.
  sim_fixture f(vmm_device());
  check_input_shares_small_chunk_with_holders(f);
  CHECK(large_pool(f.stats().reserved_bytes) == 0);
}

TEST_CASE("graph memory stats: the same when the stream holds large blocks", "[private_pool][stats]") {
  // In a long test run the side stream may still hold memory of earlier
  // tests; without a free small block it opens a small chunk all the same.
  sim_fixture f(vmm_device());
  void* held = f.alloc.allocate(12_MiB, f.s1);
  check_input_shares_small_chunk_with_holders(f);
  f.alloc.free(held);
  f.check_consistent();
}

TEST_CASE("graph memory stats: the same when a free large block of the stream fits the input",
          "[private_pool][stats]") {
  // What the H200 showed after the other TestCuda tests: the side stream
  // holds no memory, but a free block of it of 1 MiB or more outlived
  // empty_cache beside another stream's tensor in the same chunk. The input
  // still opens a small chunk, which the holders share. (4 MiB chunks make
  // room for both in one chunk.)
  allocator_config cfg;
  cfg.vmm_chunk_bytes = 4_MiB;
  sim_fixture f(vmm_device(), cfg);
  void* other = f.alloc.allocate(1_MiB + 512, f.s2);   // chunk 0; the rest is free, of s2
  void* borrowed = f.alloc.allocate(2_MiB, f.s1);      // s1 borrows that rest
  f.alloc.free(borrowed);                              // and leaves it free, of s1
  f.alloc.empty_cache();                               // chunk 0 stays: `other` lives in it
  std::size_t largest_free = 0;
  f.alloc.cache_info(&largest_free, nullptr);
  REQUIRE(largest_free >= 1_MiB);
  REQUIRE(small_pool(f.stats().segment) == 0);
  check_input_shares_small_chunk_with_holders(f, 4_MiB);
  f.alloc.free(other);
  f.check_consistent();
}

TEST_CASE("graph memory stats: a stream holding memory fills its free large block", "[private_pool][stats]") {
  // Only a stream that holds nothing opens a small chunk ahead of its
  // cached large blocks: one holding memory fills the free tail of its
  // large chunk with a mid-size request, as before.
  sim_fixture f(vmm_device());
  void* held = f.alloc.allocate(12_MiB + 512_KiB, f.s1);  // 7 chunks; 1.5 MiB of the last free
  void* mid = f.alloc.allocate(1_MiB, f.s1);
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(mid));
  REQUIRE(seg != nullptr);
  CHECK(!seg->is_small);
  CHECK(small_pool(f.stats().segment) == 0);
  CHECK(large_pool(f.stats().reserved_bytes) == i64(14_MiB));
  f.check_consistent();
  for (void* p : {held, mid}) f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("graph memory stats: a stream with a free small block sends mid-size requests to the large range",
          "[private_pool][stats]") {
  sim_fixture f(vmm_device());
  // One small chunk, 1.5 MiB of it in use: its free rest is too small for
  // 1 MiB but serves the stream's small requests.
  std::vector<void*> small;
  for (int i = 0; i < 6; ++i) small.push_back(f.alloc.allocate(256_KiB, f.s1));
  REQUIRE(small_pool(f.stats().segment) == 1);
  void* mid = f.alloc.allocate(1_MiB, f.s1);  // fits nowhere: the large range grows
  CHECK(!find_segment(f.snapshot(), addr(mid))->is_small);
  CHECK(small_pool(f.stats().segment) == 1);
  f.check_consistent();
  f.alloc.free(mid);
  for (void* p : small) f.alloc.free(p);
  f.check_consistent();
}
