// Note [ping-pong hand-offs] on the simulated device: a block that streams
// keep handing back and forth is handed straight back once, then the
// requesting stream grows a block of its own -- unless growth cannot
// happen (memory fraction, device full, garbage collection due), or the
// block came back only after the window.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

// The 4 MiB block of the bench's cross pattern: expandable segments map it
// exactly; with plain segments a 12 MiB request gets a segment of its own.
// Either way a hand-off moves the whole block and leaves nothing behind.
struct exact_block {
  const char* name;
  sim_config device;
  std::size_t bytes;
};

std::vector<exact_block> exact_blocks() {
  return {{"expandable segments", vmm_device(), 4_MiB}, {"plain segments", plain_device(), 12_MiB}};
}

// A memory fraction of the 80 GiB device that allows `bytes`.
double fraction_for(std::size_t bytes) { return static_cast<double>(bytes) / static_cast<double>(80_GiB); }

// One pair of the cross pattern: allocate and free on `stream`.
void* use_once(sim_fixture& f, std::size_t bytes, stream_handle stream) {
  void* p = f.alloc.allocate(bytes, stream);
  f.alloc.free(p);
  return p;
}

std::int64_t hand_offs(const sim_fixture& f) { return f.stats().num_cross_stream_reuses; }

}  // namespace

TEST_CASE("ping-pong: a block handed back twice in a row stays; the other stream grows", "[ping_pong]") {
  for (const exact_block& kind : exact_blocks()) {
    INFO(kind.name);
    sim_fixture f(kind.device);
    void* first = use_once(f, kind.bytes, f.s1);
    CHECK(use_once(f, kind.bytes, f.s2) == first);  // handed s1 -> s2
    CHECK(use_once(f, kind.bytes, f.s1) == first);  // straight back, once
    CHECK(hand_offs(f) == 2);
    const std::int64_t reserved = all(f.stats().reserved_bytes);

    void* own = use_once(f, kind.bytes, f.s2);  // a second time: s2 grows
    CHECK(own != first);
    CHECK(hand_offs(f) == 2);
    CHECK(all(f.stats().reserved_bytes) == reserved + static_cast<std::int64_t>(kind.bytes));
    CHECK(f.stats().num_alloc_retries == 0);

    // From now on each stream hits its own cached block: no event, no wait.
    const sim_counters before = f.sim.counters();
    for (int i = 0; i < 100; ++i) {
      CHECK(use_once(f, kind.bytes, f.s1) == first);
      CHECK(use_once(f, kind.bytes, f.s2) == own);
    }
    CHECK(hand_offs(f) == 2);
    CHECK(f.sim.counters().event_records == before.event_records);
    CHECK(f.sim.counters().stream_waits == before.stream_waits);
    f.check_consistent();
  }
}

TEST_CASE("ping-pong: the block is still handed back when growth is impossible", "[ping_pong]") {
  for (const bool by_fraction : {true, false}) {
    // Room for one block, not two: under the memory fraction, or on the device.
    for (exact_block kind : exact_blocks()) {
      INFO(kind.name << (by_fraction ? ", memory fraction" : ", device full"));
      if (!by_fraction) kind.device.capacity_bytes = kind.bytes + 2_MiB;
      sim_fixture f(kind.device);
      if (by_fraction) f.alloc.set_memory_fraction(fraction_for(kind.bytes + 2_MiB));
      void* first = nullptr;
      for (int i = 0; i < 50; ++i) {
        void* a = use_once(f, kind.bytes, f.s1);
        void* b = use_once(f, kind.bytes, f.s2);
        if (i == 0) first = a;
        CHECK(a == first);
        CHECK(b == first);
      }
      CHECK(hand_offs(f) == 99);  // every allocation but the first
      CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(kind.bytes));
      CHECK(f.stats().num_alloc_retries == 0);  // the ladder never ran
      CHECK(f.stats().num_ooms == 0);
      f.check_consistent();
    }
  }
}

TEST_CASE("ping-pong: the block is handed back when growth would collect garbage", "[ping_pong]") {
  allocator_config c;
  c.garbage_collection_threshold = 0.25;
  for (const exact_block& kind : exact_blocks()) {
    INFO(kind.name);
    sim_fixture f(kind.device, c);
    // Room for three blocks, but the cached block alone is past the threshold.
    f.alloc.set_memory_fraction(fraction_for(3 * kind.bytes));
    void* first = use_once(f, kind.bytes, f.s1);
    for (int i = 0; i < 10; ++i) {
      CHECK(use_once(f, kind.bytes, f.s2) == first);
      CHECK(use_once(f, kind.bytes, f.s1) == first);
    }
    CHECK(hand_offs(f) == 20);
    CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(kind.bytes));
    f.check_consistent();
  }
}

TEST_CASE("ping-pong: a block that comes back after the window is handed over", "[ping_pong]") {
  // Hand-offs s1 -> s2 and straight back, then `between` allocations of
  // another pool on s3 before s2 asks again: within 16 allocations of the
  // last move it is ping-pong, beyond them it is not.
  const bool beyond = GENERATE(false, true);
  const int between = beyond ? 16 : 15;
  INFO("allocations since the last move: " << between + 1);
  // Plain segments: expandable ones would stitch chunks between the pools.
  sim_fixture f(plain_device());
  void* first = use_once(f, 12_MiB, f.s1);
  use_once(f, 12_MiB, f.s2);
  use_once(f, 12_MiB, f.s1);
  REQUIRE(hand_offs(f) == 2);
  for (int i = 0; i < between; ++i) use_once(f, 512, f.s3);
  void* again = use_once(f, 12_MiB, f.s2);
  CHECK((again == first) == beyond);
  CHECK(hand_offs(f) == (beyond ? 3 : 2));
  f.check_consistent();
}
