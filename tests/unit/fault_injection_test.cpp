// Device faults injected through the simulated device at each step the
// allocator takes (segment growth, event create/record/query/sync, stream
// waits, segment release inside empty_cache): afterwards the allocator is
// consistent, the device holds exactly what it reserves, nothing leaks once
// everything is freed, and the next request succeeds when memory exists.
// Faults in the virtual-memory operations (reserve, create, map, unmap) are
// in expandable_segments_test.cpp; these tests use plain segments.
#include <cstddef>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

// Checks after a fault: consistent now, a fresh request of `bytes` succeeds
// once the fault is gone, and after freeing `live` and emptying the cache
// the device holds nothing.
void check_recovers(sim_fixture& f, std::vector<void*> live, std::size_t bytes = 4_MiB) {
  f.check_consistent();
  f.sim.clear_faults();
  void* p = f.alloc.allocate(bytes, f.s1);
  REQUIRE(p != nullptr);
  CHECK(f.sim.is_device_memory(p, bytes));
  f.check_consistent();
  live.push_back(p);
  for (void* q : live) f.alloc.free(q);
  f.sim.complete_all_events();
  f.alloc.empty_cache();
  f.check_consistent();
  CHECK(f.sim.used_bytes() == 0);
  CHECK(f.sim.live_segments() == 0);
  CHECK(all(f.stats().active) == 0);
}

constexpr status_code k_codes[] = {status_code::out_of_memory, status_code::device_error};

const char* code_name(status_code code) { return code == status_code::out_of_memory ? "out_of_memory" : "device_error"; }

}  // namespace

TEST_CASE("fault: segment growth fails on the first try", "[fault]") {
  for (status_code code : k_codes) {
    CAPTURE(code_name(code));
    sim_fixture f(manual_events(1_GiB));
    void* keep = f.alloc.allocate(4_KiB, f.s1);
    f.sim.fail_nth(sim_fault_point::allocate_segment, 1, code);
    if (code == status_code::out_of_memory) {
      // The ladder retries after releasing the cache; the retry succeeds.
      void* p = f.alloc.allocate(30_MiB, f.s1);
      CHECK(p != nullptr);
      CHECK(f.stats().num_alloc_retries == 1);
      check_recovers(f, {keep, p});
    } else {
      // A real device error is not an OOM: it surfaces at once.
      REQUIRE_THROWS_AS(f.alloc.allocate(30_MiB, f.s1), device_failure);
      CHECK(f.stats().num_device_alloc == 1);
      check_recovers(f, {keep});
    }
  }
}

TEST_CASE("fault: segment growth fails at every try of the OOM ladder", "[fault]") {
  sim_fixture f(manual_events(1_GiB), allocator_config::parse("max_split_size_mb:40"));
  void* keep = f.alloc.allocate(4_KiB, f.s1);
  // An oversize cached block and a pending free give stages 5 and 6 work.
  f.alloc.free(f.alloc.allocate(60_MiB, f.s1));
  void* pending = f.alloc.allocate(8_MiB, f.s1);
  f.alloc.record_stream(pending, f.s2);
  f.alloc.free(pending);
  f.sim.fail_always(sim_fault_point::allocate_segment);
  try {
    f.alloc.allocate(100_MiB, f.s1);
    FAIL("allocate returned while every segment allocation fails");
  } catch (const out_of_memory& e) {
    CHECK(e.context().requested_bytes == 100_MiB);
  }
  // Stage 6 waited for the pending free and gave every unused segment back.
  CHECK(f.sim.pending_events().empty());
  CHECK(f.sim.live_segments() == 1);
  check_recovers(f, {keep}, 100_MiB);
}

TEST_CASE("fault: releasing a segment fails while the OOM ladder makes room", "[fault]") {
  sim_fixture f(manual_events(100_MiB), allocator_config::parse("max_split_size_mb:40"));
  f.alloc.free(f.alloc.allocate(60_MiB, f.s1));
  REQUIRE(f.sim.used_bytes() == 60_MiB);
  // Stage 5 tries to return the cached 60 MiB segment and the device
  // refuses; stage 6 tries again and succeeds, so the request is served.
  f.sim.fail_nth(sim_fault_point::free_segment, 1, status_code::device_error);
  void* p = f.alloc.allocate(80_MiB, f.s1);
  CHECK(p != nullptr);
  CHECK(f.sim.live_segments() == 1);
  f.check_consistent();
  // When the device refuses every release, the request is an OOM and the
  // cached segment is still accounted as reserved.
  f.alloc.free(p);
  f.sim.fail_always(sim_fault_point::free_segment, status_code::device_error);
  REQUIRE_THROWS_AS(f.alloc.allocate(90_MiB, f.s2), out_of_memory);
  CHECK(f.sim.used_bytes() == 80_MiB);
  check_recovers(f, {}, 90_MiB);
}

TEST_CASE("fault: event creation fails when a free must wait for a stream", "[fault]") {
  sim_fixture f(manual_events(1_GiB));
  void* p = f.alloc.allocate(1_MiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.sim.fail_always(sim_fault_point::create_event, status_code::device_error);
  REQUIRE_NOTHROW(f.alloc.free(p));
  // Without an event the block stays pending until a device synchronization.
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 1);
  f.check_consistent();
  const std::size_t syncs = f.sim.counters().device_syncs;
  f.alloc.empty_cache();
  CHECK(f.sim.counters().device_syncs == syncs + 1);
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 0);
  CHECK(f.sim.live_segments() == 0);
  check_recovers(f, {});
}

TEST_CASE("fault: event record fails when a free must wait for a stream", "[fault]") {
  sim_fixture f(manual_events(1_GiB));
  void* p = f.alloc.allocate(1_MiB, f.s1);
  void* q = f.alloc.allocate(1_MiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.alloc.record_stream(p, f.s3);
  // One of the two stream uses gets its event, the other falls back to the
  // device synchronization.
  f.sim.fail_nth(sim_fault_point::record_event, 2, status_code::device_error);
  REQUIRE_NOTHROW(f.alloc.free(p));
  CHECK(f.sim.pending_events().size() == 1);
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 1);
  f.check_consistent();
  f.sim.complete_all_events();
  // The completed event alone does not release the block: the failed
  // record still needs a device sync, which the OOM ladder or empty_cache
  // provides.
  void* r = f.alloc.allocate(4_KiB, f.s1);
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 1);
  f.alloc.empty_cache();
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 0);
  check_recovers(f, {q, r});
}

TEST_CASE("fault: event query fails while a free is pending", "[fault]") {
  sim_fixture f(manual_events(1_GiB));
  void* p = f.alloc.allocate(1_MiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.alloc.free(p);
  f.sim.complete_all_events();
  f.sim.fail_always(sim_fault_point::query_event, status_code::device_error);
  // A query that fails proves nothing: the block stays pending.
  void* q = f.alloc.allocate(1_MiB, f.s1);
  CHECK(q != p);
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 1);
  f.check_consistent();
  f.sim.clear_faults();
  void* r = f.alloc.allocate(1_MiB, f.s1);
  CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 0);
  check_recovers(f, {q, r});
}

TEST_CASE("fault: event synchronize and device synchronize fail in the OOM ladder", "[fault]") {
  sim_fixture f(manual_events(64_MiB));
  void* p = f.alloc.allocate(40_MiB, f.s1);
  f.alloc.record_stream(p, f.s2);
  f.alloc.free(p);
  SECTION("event sync fails, device sync rescues") {
    f.sim.fail_always(sim_fault_point::synchronize_event, status_code::device_error);
    void* q = f.alloc.allocate(40_MiB, f.s1);
    CHECK(q == p);
    CHECK(f.sim.counters().device_syncs >= 1);
    check_recovers(f, {q});
  }
  SECTION("both fail: out_of_memory and the block stays pending") {
    f.sim.fail_always(sim_fault_point::synchronize_event, status_code::device_error);
    f.sim.fail_always(sim_fault_point::synchronize_device, status_code::device_error);
    REQUIRE_THROWS_AS(f.alloc.allocate(40_MiB, f.s1), out_of_memory);
    CHECK(count_state(f.snapshot(), block_state::active_pending_free) == 1);
    CHECK(f.sim.used_bytes() == 40_MiB);
    f.check_consistent();
    f.sim.clear_faults();
    f.sim.complete_all_events();
    check_recovers(f, {}, 40_MiB);
  }
}

TEST_CASE("fault: cross-stream hand-off fails at the record or the wait", "[fault]") {
  for (sim_fault_point point : {sim_fault_point::create_event, sim_fault_point::record_event,
                                sim_fault_point::stream_wait_event}) {
    CAPTURE(static_cast<int>(point));
    sim_fixture f(manual_events(1_GiB));
    f.alloc.free(f.alloc.allocate(30_MiB, f.s1));
    f.sim.fail_always(point, status_code::device_error);
    // The borrow from stream s1's cache fails; the allocator grows instead.
    void* p = f.alloc.allocate(30_MiB, f.s2);
    CHECK(p != nullptr);
    CHECK(f.stats().num_cross_stream_reuses == 0);
    CHECK(f.sim.live_segments() == 2);
    check_recovers(f, {p});
  }
}

TEST_CASE("fault: empty_cache fails to free the second segment", "[fault]") {
  sim_fixture f(manual_events(1_GiB));
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(f.alloc.allocate(30_MiB, f.s1));
  void* keep = f.alloc.allocate(4_KiB, f.s1);
  for (void* p : blocks) f.alloc.free(p);
  REQUIRE(f.sim.live_segments() == 4);
  f.sim.fail_nth(sim_fault_point::free_segment, 2, status_code::device_error);
  REQUIRE_NOTHROW(f.alloc.empty_cache());
  // The first and third segments went back; the second stays cached and
  // counted, and the live small block was never touched.
  CHECK(f.sim.live_segments() == 2);
  CHECK(f.sim.used_bytes() == 30_MiB + 2_MiB);
  CHECK(f.alloc.allocation_size(keep) == 4_KiB);
  f.check_consistent();
  // The cached segment still serves requests, and a later empty_cache
  // returns it.
  void* again = f.alloc.allocate(30_MiB, f.s1);
  CHECK(f.sim.live_segments() == 2);
  f.alloc.free(again);
  f.alloc.empty_cache();
  CHECK(f.sim.live_segments() == 1);
  check_recovers(f, {keep});
}

TEST_CASE("fault: every device call fails once, in turn, during a mixed workload", "[fault]") {
  const sim_fault_point points[] = {
      sim_fault_point::allocate_segment,  sim_fault_point::free_segment,     sim_fault_point::create_event,
      sim_fault_point::record_event,      sim_fault_point::query_event,      sim_fault_point::synchronize_event,
      sim_fault_point::stream_wait_event, sim_fault_point::synchronize_device,
  };
  for (sim_fault_point point : points) {
    for (std::size_t nth = 1; nth <= 4; ++nth) {
      CAPTURE(static_cast<int>(point), nth);
      sim_fixture f(manual_events(256_MiB), allocator_config::parse("max_split_size_mb:40"));
      f.sim.fail_nth(point, nth, status_code::device_error);
      std::vector<void*> live;
      // Each step either succeeds or throws one of the allocator's errors;
      // in both cases the allocator stays consistent.
      const auto step = [&](auto&& action) {
        try {
          action();
        } catch (const out_of_memory&) {
        } catch (const device_failure&) {
        }
        const std::string problem = consistency_problem(f.alloc, f.sim);
        INFO(problem);
        REQUIRE(problem.empty());
      };
      for (int round = 0; round < 3; ++round) {
        for (std::size_t bytes : {4_KiB, 3_MiB, 50_MiB}) {
          step([&] { live.push_back(f.alloc.allocate(bytes, round % 2 == 0 ? f.s1 : f.s2)); });
        }
        if (!live.empty()) {
          f.alloc.record_stream(live.front(), f.s3);
          f.alloc.free(live.front());
          live.erase(live.begin());
        }
        f.sim.complete_stream(f.s3);
        step([&] { f.alloc.empty_cache(); });
      }
      check_recovers(f, live, 50_MiB);
    }
  }
}

TEST_CASE("fault: nothing leaks on the device once the allocator is gone", "[fault]") {
  sim_backend sim(manual_events(1_GiB));
  {
    caching_allocator alloc(sim, allocator_config{});
    const stream_handle s1 = sim.new_stream();
    const stream_handle s2 = sim.new_stream();
    void* p = alloc.allocate(1_MiB, s1);
    alloc.record_stream(p, s2);
    sim.fail_nth(sim_fault_point::record_event, 1, status_code::device_error);
    alloc.free(p);
    void* q = alloc.allocate(30_MiB, s1);
    alloc.record_stream(q, s2);
    alloc.free(q);  // pending on an event that never completes
    alloc.validate();
    CHECK(sim.live_events() > 0);
  }
  CHECK(sim.live_segments() == 0);
  CHECK(sim.used_bytes() == 0);
  CHECK(sim.live_events() == 0);
}
