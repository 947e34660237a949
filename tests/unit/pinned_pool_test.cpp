// pinned_pool on the simulated host backend: size classes, slabs and pin
// methods, best fit, split and coalesce, event-safe reuse under adversarial
// completion orders, capacity, trim, backend faults, stats (checked against
// a recount after every step) and a randomized invariant run.
#include "streamalloc/streams/pinned_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/streams/sim_host_backend.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"

using namespace streamalloc;

namespace {

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool overlaps(std::uintptr_t a, std::size_t a_size, std::uintptr_t b, std::size_t b_size) {
  return a < b + b_size && b < a + a_size;
}

sim_host_config manual() { return sim_host_config{}; }

sim_host_config immediate() {
  sim_host_config c;
  c.complete_immediately = true;
  return c;
}

pinned_pool_config with_capacity(std::size_t bytes) {
  pinned_pool_config c;
  c.capacity_bytes = bytes;
  return c;
}

// The message of the E that `f` throws; fails the test if it throws nothing.
template <typename E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

using streamalloc::test::contains;

struct fixture {
  explicit fixture(sim_host_config host = manual(), pinned_pool_config config = {}) : sim(host), pool(sim, config) {}

  // validate() (structure + stats recount; throws on a violation) and the host-side accounting:
  // the pool's slabs are exactly what the backend has pinned.
  void check() const {
    REQUIRE_NOTHROW(pool.validate());
    const pinned_pool_stats st = pool.stats();
    REQUIRE(st.allocated_bytes.current == static_cast<std::int64_t>(sim.pinned_bytes()));
    REQUIRE(st.allocations.current == static_cast<std::int64_t>(sim.pinned_ranges()));
    REQUIRE(st.cached_bytes == st.allocated_bytes.current - st.active_bytes.current);
  }

  std::int64_t active() const { return pool.stats().active_requests.current; }

  sim_host_backend sim;
  pinned_pool pool;
};

}  // namespace

TEST_CASE("pinned_pool: size classes are 512-byte steps up to 4 KiB, then 8 per doubling", "[pinned_pool]") {
  CHECK(pinned_pool::round_size(0) == 512);
  CHECK(pinned_pool::round_size(1) == 512);
  CHECK(pinned_pool::round_size(512) == 512);
  CHECK(pinned_pool::round_size(513) == 1024);
  CHECK(pinned_pool::round_size(4096) == 4096);
  CHECK(pinned_pool::round_size(4097) == 4608);
  CHECK(pinned_pool::round_size(5000) == 5120);
  CHECK(pinned_pool::round_size(8192) == 8192);
  CHECK(pinned_pool::round_size(8193) == 9216);
  CHECK(pinned_pool::round_size(1_MiB) == 1_MiB);
  CHECK(pinned_pool::round_size(1_MiB + 1) == 1_MiB + 128_KiB);
  CHECK(pinned_pool::round_size(3_MiB) == 3_MiB);
  CHECK(pinned_pool::round_size(100'000'000) == 96_MiB);  // 12 steps of 2^26 / 8
  CHECK(pinned_pool::round_size(256_MiB) == 256_MiB);
  CHECK(pinned_pool::round_size(256_MiB + 1) == 288_MiB);

  SECTION("every class is a 512 multiple, within 12.5 % above 4 KiB, and monotonic") {
    std::size_t previous = 0;
    for (std::size_t n = 1; n <= 300_KiB; n += 97) {
      const std::size_t r = pinned_pool::round_size(n);
      INFO("n = " << n);
      REQUIRE(r >= n);
      REQUIRE(r % 512 == 0);
      REQUIRE(r >= previous);
      if (n > 4096) REQUIRE((r - n) * 8 < r);
      previous = r;
    }
  }
  SECTION("each doubling above 4 KiB holds exactly 8 classes") {
    for (std::size_t low : {4_KiB, 64_KiB, 1_MiB, 64_MiB}) {
      std::size_t classes = 0;
      std::size_t last = 0;
      const std::size_t step = low / 64;  // finer than the class step
      for (std::size_t n = low + 1; n <= 2 * low; n += step) {
        const std::size_t r = pinned_pool::round_size(n);
        if (r != last) ++classes, last = r;
      }
      INFO("octave above " << low);
      CHECK(classes == 8);
    }
  }
  SECTION("absurd requests are usage errors") {
    REQUIRE_THROWS_AS(pinned_pool::round_size(~std::size_t{0}), usage_error);
  }
}

TEST_CASE("pinned_pool: small requests share a 2 MiB slab; blocks are real, aligned and disjoint", "[pinned_pool]") {
  fixture f;
  std::vector<void*> blocks;
  const std::vector<std::size_t> sizes = {1, 100, 512, 513, 4097, 70'000, 300'000, 1_MiB};
  for (std::size_t size : sizes) {
    void* p = f.pool.allocate(size);
    REQUIRE(p != nullptr);
    CHECK(addr(p) % 512 == 0);
    CHECK(f.pool.block_size(p) == pinned_pool::round_size(size));
    CHECK(f.sim.is_pinned(p, f.pool.block_size(p)));
    blocks.push_back(p);
    f.check();
  }
  CHECK(f.sim.pinned_ranges() == 1);
  CHECK(f.sim.pinned_bytes() == 2_MiB);
  // Filling each block with its own byte and reading all back proves the
  // blocks do not overlap and are ordinary read/write memory.
  for (std::size_t i = 0; i < blocks.size(); ++i) std::memset(blocks[i], static_cast<int>(i + 1), sizes[i]);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const auto* bytes = static_cast<const unsigned char*>(blocks[i]);
    for (std::size_t k = 0; k < sizes[i]; k += 97) REQUIRE(bytes[k] == i + 1);
  }
  const pinned_pool_stats st = f.pool.stats();
  CHECK(st.misses == 1);
  CHECK(st.hits == static_cast<std::int64_t>(sizes.size()) - 1);
  CHECK(st.active_requests.current == static_cast<std::int64_t>(sizes.size()));
  std::int64_t requested = 0;
  for (std::size_t size : sizes) requested += static_cast<std::int64_t>(size);
  CHECK(st.requested_bytes.current == requested);
  for (void* p : blocks) f.pool.free(p);
  f.check();
  CHECK(f.pool.stats().cached_bytes == static_cast<std::int64_t>(2_MiB));
}

TEST_CASE("pinned_pool: a large request gets its own slab, pinned by the size-dependent method", "[pinned_pool]") {
  pinned_pool_config config;
  config.register_min_bytes = 8_MiB;
  fixture f(manual(), config);

  void* a = f.pool.allocate(3_MiB + 1);  // class 3.25 MiB, slab 4 MiB: host_alloc
  CHECK(f.pool.block_size(a) == 4_MiB);  // 0.75 MiB would remain: not worth a split
  CHECK(f.sim.pinned_bytes() == 4_MiB);
  CHECK(f.sim.counters().host_allocs == 1);
  void* b = f.pool.allocate(9_MiB);  // class 9 MiB, slab 10 MiB: registered
  CHECK(f.sim.pinned_bytes() == 14_MiB);
  CHECK(f.sim.counters().register_allocs == 1);
  CHECK(f.pool.stats().misses == 2);
  f.check();

  SECTION("register pages are readable and writable across the slab") {
    std::memset(b, 0x5a, 9_MiB);
    CHECK(static_cast<unsigned char*>(b)[9_MiB - 1] == 0x5a);
  }
  SECTION("register_min_bytes 0 registers everything, SIZE_MAX nothing") {
    pinned_pool_config always;
    always.register_min_bytes = 0;
    fixture g(manual(), always);
    g.pool.free(g.pool.allocate(1));
    CHECK(g.sim.counters().register_allocs == 1);
    pinned_pool_config never;
    never.register_min_bytes = ~std::size_t{0};
    fixture h(manual(), never);
    h.pool.free(h.pool.allocate(64_MiB));
    CHECK(h.sim.counters().register_allocs == 0);
    CHECK(h.sim.counters().host_allocs == 1);
    g.check();
    h.check();
  }
  f.pool.free(a);
  f.pool.free(b);
  f.check();
}

TEST_CASE("pinned_pool: best fit, split and coalesce", "[pinned_pool]") {
  fixture f;

  SECTION("the smallest free block that fits wins, lowest address on ties") {
    void* a = f.pool.allocate(8_KiB);
    void* sep1 = f.pool.allocate(512);
    void* b = f.pool.allocate(4_KiB);
    void* sep2 = f.pool.allocate(512);
    void* c = f.pool.allocate(4_KiB);
    void* sep3 = f.pool.allocate(512);
    f.pool.free(a);
    f.pool.free(c);
    f.pool.free(b);
    f.check();
    CHECK(f.pool.allocate(3_KiB) == b);  // b and c are 4 KiB; b is lower
    CHECK(f.pool.allocate(4_KiB) == c);
    CHECK(f.pool.allocate(5_KiB) == a);  // only a fits
    f.check();
    (void)sep1, (void)sep2, (void)sep3;
  }
  SECTION("a split leaves the rest of the block free and usable") {
    void* a = f.pool.allocate(64_KiB);
    void* guard = f.pool.allocate(512);
    f.pool.free(a);
    void* first = f.pool.allocate(16_KiB);
    CHECK(first == a);
    void* second = f.pool.allocate(48_KiB);
    CHECK(addr(second) == addr(a) + 16_KiB);
    f.check();
    CHECK(f.pool.stats().misses == 1);
    (void)guard;
  }
  SECTION("freed neighbours merge both ways") {
    void* a = f.pool.allocate(4_KiB);
    void* b = f.pool.allocate(4_KiB);
    void* c = f.pool.allocate(4_KiB);
    void* guard = f.pool.allocate(4_KiB);
    f.pool.free(a);
    f.pool.free(c);
    f.check();
    f.pool.free(b);  // merges with a on the left and c on the right
    f.check();
    CHECK(f.pool.allocate(12_KiB) == a);
    (void)guard;
  }
  SECTION("freeing everything leaves one idle slab that trim releases") {
    std::vector<void*> blocks;
    for (int i = 0; i < 20; ++i) blocks.push_back(f.pool.allocate(static_cast<std::size_t>(i) * 1000 + 1));
    std::mt19937 rng(7);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (void* p : blocks) {
      f.pool.free(p);
      f.check();
    }
    CHECK(f.pool.trim() == 2_MiB);
    CHECK(f.sim.pinned_bytes() == 0);
    f.check();
  }
  SECTION("large slabs split only when 1 MiB or more would remain") {
    void* a = f.pool.allocate(2_MiB + 256_KiB);  // slab 4 MiB, 1.75 MiB remain: split
    CHECK(f.pool.block_size(a) == 2_MiB + 256_KiB);
    void* b = f.pool.allocate(1_MiB + 512_KiB);  // served from the remainder
    CHECK(addr(b) == addr(a) + 2_MiB + 256_KiB);
    CHECK(f.pool.stats().misses == 1);
    void* c = f.pool.allocate(1_MiB + 1);  // class 1.125 MiB, slab 2 MiB, 0.875 MiB remain: no split
    CHECK(f.pool.block_size(c) == 2_MiB);
    void* d = f.pool.allocate(512_KiB);  // small: never from a large slab
    CHECK(f.sim.pinned_ranges() == 3);
    f.check();
    for (void* p : {a, b, c, d}) f.pool.free(p);
    f.check();
  }
}

TEST_CASE("pinned_pool: a block used by a copy is reused only after its events complete", "[pinned_pool]") {
  fixture f;
  const stream_handle s1 = 11, s2 = 12, s3 = 13;

  SECTION("one stream") {
    void* p = f.pool.allocate(4_KiB);
    REQUIRE(f.pool.record_event(p, {s1, 0}));
    f.pool.free(p);
    f.check();
    CHECK(f.pool.stats().pending_blocks == 1);
    CHECK(f.active() == 1);
    void* q = f.pool.allocate(4_KiB);
    CHECK_FALSE(overlaps(addr(q), 4_KiB, addr(p), 4_KiB));
    f.check();
    f.sim.complete_stream(s1);
    CHECK(f.pool.stats().pending_blocks == 1);  // nobody polled yet
    CHECK(f.pool.process_events() == 1);
    f.check();
    CHECK(f.pool.allocate(4_KiB) == p);
  }
  SECTION("a miss polls pending blocks before making a slab") {
    void* p = f.pool.allocate(1_MiB);
    void* q = f.pool.allocate(1_MiB);  // fills the 2 MiB slab
    f.pool.record_event(p, {s1, 0});
    f.pool.free(p);
    f.sim.complete_stream(s1);
    CHECK(f.pool.allocate(1_MiB) == p);
    CHECK(f.sim.pinned_ranges() == 1);
    CHECK(f.pool.stats().hits == 2);
    (void)q;
  }
  SECTION("events on three streams, completed in every order") {
    const std::vector<stream_handle> streams = {s1, s2, s3};
    std::vector<int> order = {0, 1, 2};
    do {
      fixture g;
      void* p = g.pool.allocate(64_KiB);
      for (stream_handle s : streams) REQUIRE(g.pool.record_event(p, {s, 0}));
      REQUIRE(g.pool.record_event(p, {s2, 0}));  // a repeat on a stream re-records its event
      CHECK(g.sim.live_events() == 3);
      g.pool.free(p);
      std::vector<void*> probes;
      for (std::size_t step = 0; step < order.size(); ++step) {
        // Before the last completion, no request may land on p.
        for (std::size_t size : {std::size_t{512}, 64_KiB, 1_MiB}) {
          void* q = g.pool.allocate(size);
          REQUIRE_FALSE(overlaps(addr(q), size, addr(p), 64_KiB));
          probes.push_back(q);
        }
        g.check();
        g.sim.complete_stream(streams[static_cast<std::size_t>(order[step])]);
        g.pool.process_events();
        g.check();
      }
      CHECK(g.pool.stats().pending_blocks == 0);
      for (void* q : probes) g.pool.free(q);
      g.pool.trim();
      g.check();
      CHECK(g.sim.pinned_bytes() == 0);
    } while (std::next_permutation(order.begin(), order.end()));
  }
  SECTION("an event that completed before the free still lets the block return") {
    void* p = f.pool.allocate(1_MiB);
    void* q = f.pool.allocate(1_MiB);  // fills the slab: the next request misses
    f.pool.record_event(p, {s1, 0});
    f.sim.complete_stream(s1);
    f.pool.free(p);
    CHECK(f.pool.stats().pending_blocks == 1);
    CHECK(f.pool.allocate(1_MiB) == p);
    f.check();
    (void)q;
  }
  SECTION("events are recycled per device, not created per copy") {
    for (int i = 0; i < 50; ++i) {
      void* p = f.pool.allocate(4_KiB);
      f.pool.record_event(p, {s1, 0});
      f.pool.record_event(p, {s2, 1});
      f.pool.free(p);
      f.sim.complete_all();
      f.pool.process_events();
    }
    CHECK(f.sim.counters().events_created == 2);
    f.check();
  }
  SECTION("an event of device 1 is created for device 1") {
    void* p = f.pool.allocate(4_KiB);
    f.pool.record_event(p, {s1, 1});
    const std::vector<event_handle> pending = f.sim.pending_events();
    REQUIRE(pending.size() == 1);
    CHECK(f.sim.event_device(pending[0]) == 1);
    f.pool.free(p);
  }
  SECTION("free with stream uses records on each, then frees") {
    void* p = f.pool.allocate(4_KiB);
    f.pool.free(p, {{s1, 0}, {s2, 0}});
    CHECK(f.pool.stats().pending_blocks == 1);
    f.sim.complete_stream(s2);
    f.pool.process_events();
    CHECK(f.pool.stats().pending_blocks == 1);
    f.sim.complete_stream(s1);
    f.pool.process_events();
    CHECK(f.pool.stats().pending_blocks == 0);
    f.check();
  }
}

TEST_CASE("pinned_pool: misuse", "[pinned_pool]") {
  fixture f;
  void* p = f.pool.allocate(4_KiB);
  int local = 0;
  CHECK_FALSE(f.pool.record_event(&local, {1, 0}));
  CHECK_FALSE(f.pool.record_event(static_cast<char*>(p) + 512, {1, 0}));
  CHECK(f.pool.block_size(&local) == 0);
  REQUIRE_THROWS_AS(f.pool.free(&local), usage_error);
  f.pool.free(nullptr);
  f.pool.free(p);
  const std::string message = message_of<usage_error>([&] { f.pool.free(p); });
  CHECK(contains(message, "double free"));
  CHECK_FALSE(f.pool.record_event(p, {1, 0}));
  f.check();
}

TEST_CASE("pinned_pool: capacity", "[pinned_pool]") {
  const stream_handle s1 = 21;

  SECTION("a request above the capacity fails at once with a clear message") {
    fixture f(manual(), with_capacity(4_MiB));
    const std::string message = message_of<pinned_out_of_memory>([&] { f.pool.allocate(4_MiB + 1); });
    CHECK(contains(message, "exceeds the pool's capacity of 4.00 MiB"));
    CHECK(f.sim.pinned_bytes() == 0);
    f.check();
  }
  SECTION("at capacity with nothing in flight: pinned_out_of_memory, the pool unchanged") {
    fixture f(manual(), with_capacity(4_MiB));
    void* a = f.pool.allocate(2_MiB);
    void* b = f.pool.allocate(2_MiB);
    const std::string message = message_of<pinned_out_of_memory>([&] { f.pool.allocate(512); });
    CHECK(contains(message, "capacity of 4.00 MiB is reached"));
    CHECK(contains(message, "no copy is in flight"));
    f.check();
    f.pool.free(a);
    CHECK(f.pool.allocate(512) != nullptr);  // a's idle slab makes room
    CHECK(f.sim.counters().releases == 1);
    CHECK(f.sim.pinned_bytes() == 4_MiB);
    f.check();
    (void)b;
  }
  SECTION("at capacity, a request waits for the oldest copy in flight") {
    fixture f(manual(), with_capacity(4_MiB));
    void* a = f.pool.allocate(2_MiB);
    void* b = f.pool.allocate(2_MiB);
    f.pool.record_event(a, {s1, 0});
    f.pool.free(a);
    const std::size_t syncs = f.sim.counters().event_syncs;
    void* c = f.pool.allocate(1_MiB + 512_KiB);
    CHECK(c == a);
    CHECK(f.sim.counters().event_syncs == syncs + 1);
    CHECK(f.pool.stats().capacity_waits == 1);
    CHECK(f.sim.queued_operations(s1) == 0);
    f.check();
    (void)b;
  }
  SECTION("idle slabs are released to make room") {
    fixture f(manual(), with_capacity(4_MiB));
    f.pool.free(f.pool.allocate(4_KiB));  // leaves an idle 2 MiB small slab
    void* big = f.pool.allocate(3_MiB);   // needs a 4 MiB slab
    CHECK(f.sim.counters().releases == 1);
    CHECK(f.sim.pinned_bytes() == 4_MiB);
    f.check();
    f.pool.free(big);
  }
  SECTION("near the capacity a slab shrinks to the size class") {
    fixture f(manual(), with_capacity(3_MiB));
    void* a = f.pool.allocate(1_MiB + 1);  // large slab of 2 MiB
    void* b = f.pool.allocate(100'000);    // small slab: 2 MiB does not fit, its class does
    CHECK(f.sim.pinned_bytes() == 2_MiB + pinned_pool::round_size(100'000));
    f.check();
    f.pool.free(a);
    f.pool.free(b);
  }
}

TEST_CASE("pinned_pool: trim releases idle slabs largest first down to keep_bytes", "[pinned_pool]") {
  fixture f;
  std::vector<void*> blocks = {f.pool.allocate(6_MiB), f.pool.allocate(4_MiB), f.pool.allocate(2_MiB + 1),
                               f.pool.allocate(4_KiB)};
  void* busy = f.pool.allocate(8_MiB);
  for (void* p : blocks) f.pool.free(p);
  // Idle: 6 + 4 + 4 (2 MiB + 1 -> class 2.25 MiB, slab 4 MiB) + 2 (small) MiB.
  CHECK(f.sim.pinned_bytes() == 24_MiB);
  CHECK(f.pool.trim(10_MiB) == 6_MiB);  // 16 idle -> 10
  CHECK(f.sim.pinned_bytes() == 18_MiB);
  f.check();
  CHECK(f.pool.trim(2_MiB) == 4_MiB + 4_MiB);  // 10 -> 6 is not enough, 2 is
  f.check();
  f.pool.empty_cache();
  CHECK(f.sim.pinned_bytes() == 8_MiB);  // the busy slab stays
  f.check();

  SECTION("pending blocks whose events completed are released too") {
    f.pool.record_event(busy, {5, 0});
    f.pool.free(busy);
    CHECK(f.pool.trim() == 0);
    f.sim.complete_all();
    CHECK(f.pool.trim() == 8_MiB);
    CHECK(f.sim.pinned_bytes() == 0);
    f.check();
    const pinned_pool_stats st = f.pool.stats();
    CHECK(st.allocations.freed == 5);
    CHECK(st.host_free_time.count == 5);
  }
}

TEST_CASE("pinned_pool: backend faults leave the pool consistent", "[pinned_pool]") {
  fixture f;

  SECTION("a refused pin is pinned_out_of_memory; the next request works") {
    f.sim.fail_nth(sim_host_fault_point::allocate_pinned, 1);
    const std::string message = message_of<pinned_out_of_memory>([&] { f.pool.allocate(4_KiB); });
    CHECK(contains(message, "injected fault at allocate_pinned"));
    f.check();
    f.pool.free(f.pool.allocate(4_KiB));
    f.check();
  }
  SECTION("a refused pin first releases idle slabs and retries") {
    f.pool.free(f.pool.allocate(4_KiB));
    f.sim.fail_nth(sim_host_fault_point::allocate_pinned, 1);
    void* p = f.pool.allocate(3_MiB);
    CHECK(p != nullptr);
    CHECK(f.sim.counters().releases == 1);
    f.check();
  }
  SECTION("a refused release keeps the slab and reports it") {
    f.pool.free(f.pool.allocate(4_KiB));
    f.sim.fail_nth(sim_host_fault_point::release_pinned, 1, status_code::device_error);
    REQUIRE_THROWS_AS(f.pool.trim(), device_failure);
    CHECK(f.sim.pinned_bytes() == 2_MiB);
    f.check();
    CHECK(f.pool.trim() == 2_MiB);
    f.check();
  }
  SECTION("a refused record throws; the block was never marked in use by a copy") {
    void* p = f.pool.allocate(4_KiB);
    f.sim.fail_nth(sim_host_fault_point::record_event, 1, status_code::device_error);
    REQUIRE_THROWS_AS(f.pool.record_event(p, {3, 0}), device_failure);
    f.pool.free(p);
    CHECK(f.pool.stats().pending_blocks == 0);
    f.check();
  }
  SECTION("free with a refused record waits for the device instead") {
    void* p = f.pool.allocate(4_KiB);
    f.sim.fail_always(sim_host_fault_point::record_event, status_code::device_error);
    f.pool.free(p, {{3, 0}});
    CHECK(f.sim.counters().device_syncs == 1);
    CHECK(f.pool.stats().pending_blocks == 0);
    f.check();
  }
  SECTION("a refused query keeps the block pending and counts the error") {
    void* p = f.pool.allocate(4_KiB);
    f.pool.record_event(p, {3, 0});
    f.pool.free(p);
    f.sim.complete_all();
    f.sim.fail_nth(sim_host_fault_point::query_event, 1, status_code::device_error);
    CHECK(f.pool.process_events() == 0);
    CHECK(f.pool.stats().event_errors == 1);
    CHECK(f.pool.process_events() == 1);
    f.check();
  }
  SECTION("a refused wait at capacity is a device_failure") {
    fixture g(manual(), with_capacity(2_MiB));
    void* p = g.pool.allocate(2_MiB);
    g.pool.record_event(p, {3, 0});
    g.pool.free(p);
    g.sim.fail_nth(sim_host_fault_point::synchronize_event, 1, status_code::device_error);
    REQUIRE_THROWS_AS(g.pool.allocate(4_KiB), device_failure);
    g.check();
    // Once the copy is waited for, p's slab is idle and makes room.
    CHECK(g.pool.allocate(4_KiB) != nullptr);
    CHECK(g.sim.counters().releases == 1);
    CHECK(g.sim.pinned_bytes() == 2_MiB);
    g.check();
  }
}

TEST_CASE("pinned_pool: stats carry torch.cuda.host_memory_stats() names", "[pinned_pool]") {
  fixture f;
  void* a = f.pool.allocate(1000);
  void* b = f.pool.allocate(5_MiB);
  f.pool.free(a);
  void* c = f.pool.allocate(1000);
  f.pool.free(b);
  f.pool.free(c);
  f.pool.trim();
  f.check();
  const pinned_pool_stats st = f.pool.stats();
  const std::map<std::string, double> m = st.to_map();
  for (const char* key : {"allocations.current",
                          "allocations.peak",
                          "allocations.allocated",
                          "allocations.freed",
                          "allocated_bytes.current",
                          "allocated_bytes.peak",
                          "allocated_bytes.allocated",
                          "allocated_bytes.freed",
                          "active_requests.current",
                          "active_requests.peak",
                          "active_requests.allocated",
                          "active_requests.freed",
                          "active_bytes.current",
                          "active_bytes.peak",
                          "active_bytes.allocated",
                          "active_bytes.freed",
                          "num_host_alloc",
                          "num_host_free",
                          "host_alloc_time.total",
                          "host_alloc_time.max",
                          "host_alloc_time.min",
                          "host_alloc_time.count",
                          "host_alloc_time.avg",
                          "host_free_time.total",
                          "host_free_time.max",
                          "host_free_time.min",
                          "host_free_time.count",
                          "host_free_time.avg",
                          "cached_bytes",
                          "hit_rate",
                          "hits",
                          "misses",
                          "pending_blocks",
                          "requested_bytes.current",
                          "capacity_bytes"}) {
    INFO(key);
    CHECK(m.count(key) == 1);
  }
  CHECK(m.at("num_host_alloc") == 2);
  CHECK(m.at("num_host_free") == 2);
  CHECK(m.at("allocations.peak") == 2);
  CHECK(m.at("allocated_bytes.peak") == static_cast<double>(2_MiB + 6_MiB));
  CHECK(m.at("active_requests.allocated") == 3);
  CHECK(m.at("active_requests.freed") == 3);
  CHECK(m.at("active_bytes.peak") == static_cast<double>(1024 + pinned_pool::round_size(5_MiB)));
  CHECK(m.at("host_alloc_time.count") == 2);
  CHECK(m.at("hits") == 1);
  CHECK(m.at("misses") == 2);
  const double rate = m.at("hit_rate");
  CHECK(rate > 1.0 / 3 - 1e-12);
  CHECK(rate < 1.0 / 3 + 1e-12);

  SECTION("peaks reset to current, accumulated counters to zero") {
    void* d = f.pool.allocate(512);
    f.pool.reset_peak_stats();
    pinned_pool_stats after = f.pool.stats();
    CHECK(after.allocations.peak == 1);
    CHECK(after.active_requests.peak == 1);
    f.pool.reset_accumulated_stats();
    after = f.pool.stats();
    CHECK(after.allocations.allocated == 0);
    CHECK(after.hits == 0);
    CHECK(after.misses == 0);
    CHECK(after.host_alloc_time.count == 0);
    CHECK(after.allocations.current == 1);
    f.pool.free(d);
    f.check();
  }
}

TEST_CASE("pinned_pool: destruction waits for copies in flight and releases everything", "[pinned_pool]") {
  sim_host_backend sim;
  {
    pinned_pool pool(sim);
    void* a = pool.allocate(4_KiB);
    void* b = pool.allocate(5_MiB);
    pool.record_event(a, {1, 0});
    pool.record_event(b, {2, 0});
    pool.free(a);  // pending; b stays allocated with its event
    CHECK(sim.queued_operations(1) == 1);
  }
  CHECK(sim.queued_operations(1) == 0);
  CHECK(sim.queued_operations(2) == 0);
  CHECK(sim.pinned_bytes() == 0);
  CHECK(sim.live_events() == 0);
}

TEST_CASE("pinned_pool: concurrent allocate, record and free", "[pinned_pool]") {
  fixture f(immediate());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&f, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<std::pair<void*, unsigned char>> live;
      for (int i = 0; i < 2000; ++i) {
        if (live.size() < 8 && rng() % 2 == 0) {
          const std::size_t size = 1 + rng() % 200'000;
          void* p = f.pool.allocate(size);
          const auto tag = static_cast<unsigned char>(rng());
          std::memset(p, tag, 512);
          live.emplace_back(p, tag);
          f.pool.record_event(p, {static_cast<stream_handle>(t + 1), 0});
        } else if (!live.empty()) {
          const auto [p, tag] = live.back();
          live.pop_back();
          // Another thread writing into this block would change its bytes.
          for (std::size_t k = 0; k < 512; ++k) {
            if (static_cast<unsigned char*>(p)[k] != tag) std::abort();
          }
          f.pool.free(p);
        }
      }
      for (const auto& [p, tag] : live) f.pool.free(p);
    });
  }
  for (std::thread& t : threads) t.join();
  f.pool.process_events();
  f.check();
  CHECK(f.active() == 0);
}

namespace {

// The randomized run: a model of what the pool must guarantee, checked
// after every step. Pending ranges are the blocks freed after copies whose
// completion the model tracks by stream position: the n-th operation on a
// stream has run once the stream has run n operations.
struct random_run {
  explicit random_run(unsigned seed, std::size_t capacity) : rng(seed), f(manual(), with_capacity(capacity)) {}

  struct live_block {
    std::size_t requested = 0;
    unsigned char tag = 0;
    std::vector<std::pair<stream_handle, std::size_t>> uses;  // stream, op position
  };
  struct pending_range {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::vector<std::pair<stream_handle, std::size_t>> uses;
  };

  std::size_t ran(stream_handle s) const {
    const auto it = enqueued.find(s);
    const std::size_t total = it == enqueued.end() ? 0 : it->second;
    return total - f.sim.queued_operations(s);
  }
  bool done(const std::vector<std::pair<stream_handle, std::size_t>>& uses) const {
    for (const auto& [s, position] : uses) {
      if (ran(s) < position) return false;
    }
    return true;
  }

  void check_allocation(void* p, std::size_t requested) {
    const std::size_t size = f.pool.block_size(p);
    REQUIRE(size >= requested);
    for (const auto& [address, b] : live)
      REQUIRE_FALSE(overlaps(addr(p), size, address, f.pool.block_size(reinterpret_cast<void*>(address))));
    for (const pending_range& r : pending) {
      if (!done(r.uses)) REQUIRE_FALSE(overlaps(addr(p), size, r.address, r.size));
    }
  }

  void step() {
    const unsigned op = rng() % 100;
    if (op < 40 && live.size() < 64) {
      // Log-uniform sizes, 1 B .. 8 MiB.
      const double exponent = std::uniform_real_distribution<double>(0, 23)(rng);
      const auto requested = static_cast<std::size_t>(std::pow(2.0, exponent));
      void* p = nullptr;
      try {
        p = f.pool.allocate(requested);
      } catch (const pinned_out_of_memory&) {
        ++refusals;
        return;
      }
      check_allocation(p, requested);
      live_block b;
      b.requested = requested;
      b.tag = static_cast<unsigned char>(rng());
      std::memset(p, b.tag, std::min<std::size_t>(requested, 4096));
      live[addr(p)] = b;
    } else if (op < 65 && !live.empty()) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      const stream_handle s = 1 + rng() % 3;
      REQUIRE(f.pool.record_event(reinterpret_cast<void*>(it->first), {s, 0}));
      it->second.uses.emplace_back(s, ++enqueued[s]);
    } else if (op < 90 && !live.empty()) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      void* p = reinterpret_cast<void*>(it->first);
      const auto* bytes = static_cast<const unsigned char*>(p);
      const unsigned char tag = it->second.tag;
      REQUIRE(std::all_of(bytes, bytes + std::min<std::size_t>(it->second.requested, 4096),
                          [tag](unsigned char v) { return v == tag; }));
      if (!it->second.uses.empty()) pending.push_back({it->first, f.pool.block_size(p), it->second.uses});
      f.pool.free(p);
      live.erase(it);
    } else if (op < 97) {
      const std::vector<event_handle> events = f.sim.pending_events();
      if (!events.empty()) f.sim.complete_event(events[rng() % events.size()]);
    } else if (op < 99) {
      f.pool.process_events();
    } else {
      f.pool.trim(rng() % 2 == 0 ? 0 : 8_MiB);
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](const pending_range& r) { return done(r.uses); }),
                  pending.end());
    f.check();
    const pinned_pool_stats st = f.pool.stats();
    REQUIRE(st.active_requests.current == static_cast<std::int64_t>(live.size()) + st.pending_blocks);
    std::int64_t requested = 0;
    for (const auto& [address, b] : live) requested += static_cast<std::int64_t>(b.requested);
    REQUIRE(st.requested_bytes.current == requested);
  }

  std::mt19937 rng;
  fixture f;
  std::map<std::uintptr_t, live_block> live;
  std::vector<pending_range> pending;
  std::map<stream_handle, std::size_t> enqueued;
  std::size_t refusals = 0;
};

}  // namespace

TEST_CASE("pinned_pool: randomized operations keep every invariant", "[pinned_pool]") {
  for (unsigned seed : {1u, 2u, 3u}) {
    for (std::size_t capacity : {std::size_t{0}, 48_MiB}) {
      INFO("seed " << seed << ", capacity " << capacity);
      random_run run(seed, capacity);
      for (int i = 0; i < 1500; ++i) run.step();
      for (const auto& [address, b] : run.live) run.f.pool.free(reinterpret_cast<void*>(address));
      run.f.sim.complete_all();
      run.f.pool.trim();
      run.f.check();
      CHECK(run.f.sim.pinned_bytes() == 0);
      if (capacity != 0) CHECK(run.f.pool.stats().allocated_bytes.peak <= static_cast<std::int64_t>(capacity));
    }
  }
}

TEST_CASE("pinned_pool: long randomized run", "[pinned_pool][slow]") {
  for (unsigned seed = 10; seed < 20; ++seed) {
    INFO("seed " << seed);
    random_run run(seed, seed % 2 == 0 ? 0 : 32_MiB);
    for (int i = 0; i < 20000; ++i) run.step();
  }
}
