// Note [capture reuse]: graph_capture_record_stream_reuse on the simulated
// device, whose graph model records the nodes and edges CUDA would.
#include "support/catch.hpp"

#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::sim_fixture;

namespace {

constexpr pool_id k_pool = 5;

allocator_config with_reuse(bool on) {
  allocator_config cfg;
  cfg.graph_capture_record_stream_reuse = on;
  return cfg;
}

// A capture on s1 that s2 and s3 may join; every allocation of the three
// streams goes to k_pool.
void begin_capture(sim_fixture& f) {
  f.alloc.begin_allocate_to_pool(k_pool, [&f](stream_handle s) { return s == f.s1 || s == f.s2 || s == f.s3; });
  f.sim.capture_begin(f.s1);
}

void end_capture(sim_fixture& f) {
  f.alloc.end_allocate_to_pool(k_pool);
  f.sim.capture_end();
}

}  // namespace

TEST_CASE("capture reuse: a block used by a forked stream returns once that stream is joined", "[caching_allocator][capture]") {
  const bool reuse = GENERATE(true, false);
  sim_fixture f(streamalloc::test::plain_device(), with_reuse(reuse));
  begin_capture(f);
  void* sink = f.alloc.allocate(32, f.s1);
  void* data1 = f.alloc.allocate(32, f.s1);
  f.sim.capture_work(f.s1);  // writes data1
  f.sim.capture_wait(f.s2, f.s1);
  void* buf2 = f.alloc.allocate(32, f.s2);
  f.sim.capture_work(f.s2);  // reads data1
  f.alloc.record_stream(data1, f.s2);
  f.alloc.free(data1);

  void* before_join = f.alloc.allocate(32, f.s1);
  CHECK(before_join != data1);
  f.check_consistent();

  f.sim.capture_wait(f.s1, f.s2);
  f.sim.capture_work(f.s1);
  void* after_join = f.alloc.allocate(32, f.s1);
  CHECK((after_join == data1) == reuse);
  f.check_consistent();

  for (void* p : {sink, buf2, before_join, after_join}) f.alloc.free(p);
  end_capture(f);
  f.sim.complete_all_events();
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(streamalloc::test::all(f.stats().active_bytes) == 0);
}

TEST_CASE("capture reuse: every use stream must be joined, not only some", "[caching_allocator][capture]") {
  sim_fixture f(streamalloc::test::plain_device(), with_reuse(true));
  const stream_handle s4 = f.sim.new_stream();
  f.alloc.begin_allocate_to_pool(k_pool, [&](stream_handle s) { return s == f.s1 || s == f.s2 || s == f.s3 || s == s4; });
  f.sim.capture_begin(f.s1);
  void* data1 = f.alloc.allocate(32, f.s1);
  f.sim.capture_work(f.s1);
  for (stream_handle s : {f.s2, f.s3, s4}) {
    f.sim.capture_wait(s, f.s1);
    f.sim.capture_work(s);
    f.alloc.record_stream(data1, s);
  }
  f.alloc.free(data1);

  // s2 joins s1, s4 joins s3: s3's subgraph is not yet ordered before s1.
  f.sim.capture_wait(f.s1, f.s2);
  f.sim.capture_work(f.s1);
  f.sim.capture_wait(f.s3, s4);
  f.sim.capture_work(f.s3);
  void* partial = f.alloc.allocate(32, f.s1);
  CHECK(partial != data1);

  f.sim.capture_wait(f.s1, f.s3);
  f.sim.capture_work(f.s1);
  void* joined = f.alloc.allocate(32, f.s1);
  CHECK(joined == data1);
  f.check_consistent();

  f.alloc.free(partial);
  f.alloc.free(joined);
  f.alloc.end_allocate_to_pool(k_pool);
  f.sim.capture_end();
  f.check_consistent();
}

TEST_CASE("capture reuse: a use outside the capture waits for the capture's end", "[caching_allocator][capture]") {
  sim_fixture f(streamalloc::test::plain_device(), with_reuse(true));
  f.alloc.begin_allocate_to_pool(k_pool, [&](stream_handle s) { return s == f.s1; });
  f.sim.capture_begin(f.s1);
  void* data1 = f.alloc.allocate(32, f.s1);
  f.alloc.record_stream(data1, f.s3);  // s3 never joins the capture
  f.alloc.free(data1);
  f.sim.capture_work(f.s1);
  void* next = f.alloc.allocate(32, f.s1);
  CHECK(next != data1);
  f.check_consistent();
  f.alloc.free(next);
  f.alloc.end_allocate_to_pool(k_pool);
  f.sim.capture_end();
  // After the capture the block waits on an event of s3, as any other free.
  f.check_consistent();
  f.sim.complete_all_events();
  f.alloc.begin_allocate_to_pool(k_pool, [&](stream_handle s) { return s == f.s1; });
  void* again = f.alloc.allocate(32, f.s1);
  CHECK((again == data1 || again == next));
  f.alloc.free(again);
  f.alloc.end_allocate_to_pool(k_pool);
  f.check_consistent();
}
