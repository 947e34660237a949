// staged_copy_engine on the simulated host backend, plus its parts: the
// sim's stream-ordered copies, host_workers and the pre-faulted mappings.
// The sim runs a copy only when its stream is completed, reading the
// staging slot at that moment, so refilling a slot before its DMA ran
// would show up as wrong bytes at the destination.
#include "streamalloc/streams/staged_copy.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/streams/host_memory.hpp"
#include "streamalloc/streams/host_workers.hpp"
#include "streamalloc/streams/pinned_pool.hpp"
#include "streamalloc/streams/sim_host_backend.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Bytes that differ at every offset and between seeds.
std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

// The first offset where a and b differ, or -1.
long first_difference(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  if (a.size() != b.size()) return 0;
  const auto mismatch = std::mismatch(a.begin(), a.end(), b.begin());
  return mismatch.first == a.end() ? -1 : static_cast<long>(mismatch.first - a.begin());
}

staged_copy_config ring(std::size_t slot_bytes, int slots) {
  staged_copy_config c;
  c.slot_bytes = slot_bytes;
  c.ring_slots = slots;
  return c;
}

sim_host_config immediate() {
  sim_host_config c;
  c.complete_immediately = true;
  return c;
}

struct fixture {
  explicit fixture(sim_host_config host = {}, pinned_pool_config pool_config = {})
      : sim(host), pool(sim, pool_config), workers(3) {}

  sim_host_backend sim;
  pinned_pool pool;
  host_workers workers;
};

}  // namespace

TEST_CASE("sim_host_backend: copies and records run in stream order when completed", "[staged_copy]") {
  sim_host_backend sim;
  void* pinned = nullptr;
  REQUIRE(sim.allocate_pinned(64, pin_method::host_alloc, &pinned));
  std::vector<unsigned char> device(64, 0);
  std::memset(pinned, 7, 64);
  event_handle e1 = 0, e2 = 0;
  REQUIRE(sim.create_event(0, &e1));
  REQUIRE(sim.create_event(0, &e2));
  REQUIRE(sim.copy_to_device_async(device.data(), pinned, 32, 1, 0));
  REQUIRE(sim.record_event(e1, 1));
  REQUIRE(sim.copy_to_device_async(device.data() + 32, pinned, 32, 1, 0));
  REQUIRE(sim.record_event(e2, 1));
  bool done = true;
  REQUIRE(sim.query_event(e1, &done));
  CHECK_FALSE(done);
  CHECK(device[0] == 0);
  CHECK(sim.pending_events() == std::vector<event_handle>{e1, e2});

  sim.complete_event(e1);
  CHECK(device[31] == 7);
  CHECK(device[32] == 0);
  REQUIRE(sim.query_event(e1, &done));
  CHECK(done);
  REQUIRE(sim.query_event(e2, &done));
  CHECK_FALSE(done);

  SECTION("completing a later record runs everything before it") {
    sim.complete_event(e2);
    CHECK(device[63] == 7);
    CHECK(sim.queued_operations(1) == 0);
  }
  SECTION("a copy from pageable memory is refused") {
    std::vector<unsigned char> pageable(64);
    const status st = sim.copy_to_device_async(device.data(), pageable.data(), 64, 1, 0);
    CHECK(st.code() == status_code::invalid_argument);
  }
  SECTION("a copy whose source was released before it ran is counted, not performed") {
    REQUIRE(sim.release_pinned(pinned, 64, pin_method::host_alloc));
    sim.complete_all();
    CHECK(sim.counters().stale_copies == 1);
    REQUIRE(sim.allocate_pinned(64, pin_method::host_alloc, &pinned));
  }
  SECTION("release must name the size and method of the allocation") {
    CHECK(sim.release_pinned(pinned, 63, pin_method::host_alloc).code() == status_code::invalid_argument);
    CHECK(sim.release_pinned(pinned, 64, pin_method::register_touched).code() == status_code::invalid_argument);
  }
  sim.complete_all();
  REQUIRE(sim.release_pinned(pinned, 64, pin_method::host_alloc));
  CHECK(sim.pinned_bytes() == 0);
}

TEST_CASE("host_workers: every task runs once; copies are exact", "[staged_copy]") {
  for (int parallelism : {1, 2, 4}) {
    host_workers workers(parallelism);
    CHECK(workers.parallelism() == parallelism);
    for (int tasks : {0, 1, 3, 17, 64}) {
      std::vector<int> hits(static_cast<std::size_t>(tasks), 0);
      workers.run(tasks, [&](int i) { ++hits[static_cast<std::size_t>(i)]; });
      INFO("parallelism " << parallelism << ", tasks " << tasks);
      CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
    }
    for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, 256_KiB + 3, 3_MiB + 17}) {
      for (std::size_t offset : {std::size_t{0}, std::size_t{5}}) {
        const std::vector<unsigned char> src = pattern(bytes + offset, 3);
        std::vector<unsigned char> dst(bytes + offset + 1, 0xee);
        workers.copy(dst.data() + offset, src.data() + offset, bytes);
        INFO("bytes " << bytes << ", offset " << offset);
        CHECK(std::equal(src.begin() + static_cast<long>(offset), src.end(), dst.begin() + static_cast<long>(offset)));
        CHECK(dst.back() == 0xee);
      }
    }
  }
}

TEST_CASE("host_workers: concurrent callers take turns", "[staged_copy]") {
  host_workers workers(3);
  std::vector<std::thread> callers;
  std::vector<int> sums(4, 0);
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 50; ++round) {
        std::vector<int> cells(10, 0);
        workers.run(10, [&](int i) { cells[static_cast<std::size_t>(i)] = i; });
        sums[static_cast<std::size_t>(c)] += std::accumulate(cells.begin(), cells.end(), 0);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int s : sums) CHECK(s == 50 * 45);
}

TEST_CASE("host_workers: a forked child runs loops inline instead of waiting for lost threads", "[staged_copy]") {
  host_workers workers(4);
  workers.run(4, [](int) {});  // the threads exist and have run once
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    alarm(10);  // a hang ends the child by SIGALRM, which the parent reports
    std::vector<int> hits(16, 0);
    workers.run(16, [&](int i) { ++hits[static_cast<std::size_t>(i)]; });
    const std::vector<unsigned char> src = pattern(1_MiB, 5);
    std::vector<unsigned char> dst(src.size());
    workers.copy(dst.data(), src.data(), src.size());
    const bool ok = std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }) && dst == src;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  INFO("child status " << status);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("map_host_pages: zeroed, writable, huge-page aligned when large", "[staged_copy]") {
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4097}, 2_MiB, 3_MiB + 5}) {
    void* p = nullptr;
    REQUIRE(map_host_pages(bytes, 3, &p));
    INFO("bytes " << bytes);
    if (bytes >= 2_MiB) CHECK(addr(p) % 2_MiB == 0);
    const auto* view = static_cast<const unsigned char*>(p);
    CHECK(std::all_of(view, view + bytes, [](unsigned char c) { return c == 0; }));
    std::memset(p, 0xab, bytes);
    CHECK(view[bytes - 1] == 0xab);
    REQUIRE(unmap_host_pages(p, bytes));
  }
  CHECK(map_host_pages(0, 1, nullptr).code() == status_code::invalid_argument);
}

TEST_CASE("staged_copy: bytes arrive exactly for many sizes and ring shapes", "[staged_copy]") {
  const std::vector<std::size_t> sizes = {1, 511, 4096, 1_MiB - 1, 1_MiB, 1_MiB + 1, 3_MiB + 7, 10_MiB + 13};
  for (std::size_t slot_bytes : {1_MiB, 4_MiB}) {
    for (int slots : {2, 3, 4}) {
      fixture f;
      staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(slot_bytes, slots));
      unsigned seed = 1;
      for (std::size_t bytes : sizes) {
        INFO("slot " << slot_bytes << ", slots " << slots << ", bytes " << bytes);
        const std::vector<unsigned char> expected = pattern(bytes, seed++);
        std::vector<unsigned char> src = expected;
        std::vector<unsigned char> device(bytes, 0);
        engine.copy_to_device(device.data(), src.data(), bytes, 1);
        // The source may be reused the moment the call returns.
        std::fill(src.begin(), src.end(), 0xcd);
        f.sim.complete_all();
        REQUIRE(first_difference(device, expected) == -1);
      }
      const staged_copy_counters c = engine.counters();
      CHECK(c.copies == sizes.size());
      CHECK(c.bytes == std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}));
      CHECK(f.sim.counters().stale_copies == 0);
      // The ring is `slots` pool blocks of slot_bytes, held by the engine.
      CHECK(f.pool.stats().active_requests.current == slots);
    }
  }
}

TEST_CASE("staged_copy: chunks are a slot at most, 1 MiB at least, and split a copy across the ring", "[staged_copy]") {
  fixture f;
  staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(16_MiB, 4));
  CHECK(engine.chunk_bytes_for(1) == 1_MiB);
  CHECK(engine.chunk_bytes_for(4_MiB) == 1_MiB);
  CHECK(engine.chunk_bytes_for(10_MiB) == 2_MiB + 512_KiB);
  CHECK(engine.chunk_bytes_for(10_MiB + 1) == 2_MiB + 512_KiB + 64_KiB);
  CHECK(engine.chunk_bytes_for(64_MiB) == 16_MiB);
  CHECK(engine.chunk_bytes_for(1_GiB) == 16_MiB);
  staged_copy_engine tiny(f.sim, f.pool, f.workers, 0, ring(256_KiB, 2));
  CHECK(tiny.chunk_bytes_for(8_MiB) == 256_KiB);
}

TEST_CASE("staged_copy: a slot is refilled only after its DMA ran", "[staged_copy]") {
  fixture f;
  staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 2));
  const std::size_t bytes = 10_MiB;  // ten 1 MiB chunks through two slots
  const std::vector<unsigned char> expected = pattern(bytes, 9);
  std::vector<unsigned char> device(bytes, 0);
  engine.copy_to_device(device.data(), expected.data(), bytes, 4);

  const staged_copy_counters c = engine.counters();
  CHECK(c.chunks == 10);
  CHECK(c.slot_waits == 8);  // chunks 3..10 each waited for the chunk two before
  // The waits ran the stream up to chunk 8's record: chunks 9 and 10
  // (a copy and a record each) are still queued, their bytes not there yet.
  CHECK(f.sim.queued_operations(4) == 4);
  const std::vector<unsigned char> head(device.begin(), device.begin() + 8_MiB);
  CHECK(std::equal(head.begin(), head.end(), expected.begin()));
  CHECK(std::all_of(device.begin() + 8_MiB, device.end(), [](unsigned char b) { return b == 0; }));
  f.sim.complete_stream(4);
  CHECK(first_difference(device, expected) == -1);

  SECTION("a second copy waits for the first copy's slots, on any stream") {
    const std::vector<unsigned char> second = pattern(3_MiB, 10);
    std::vector<unsigned char> other(3_MiB, 0);
    engine.copy_to_device(device.data(), expected.data(), bytes, 4);  // slots busy again
    engine.copy_to_device(other.data(), second.data(), second.size(), 5);
    f.sim.complete_all();
    CHECK(first_difference(other, second) == -1);
    CHECK(first_difference(device, expected) == -1);
    CHECK(f.sim.counters().stale_copies == 0);
  }
  SECTION("copies to one destination land in stream order") {
    const std::vector<unsigned char> later = pattern(bytes, 11);
    engine.copy_to_device(device.data(), expected.data(), bytes, 4);
    engine.copy_to_device(device.data(), later.data(), bytes, 4);
    f.sim.complete_all();
    CHECK(first_difference(device, later) == -1);
  }
  SECTION("synchronize leaves no DMA reading a slot") {
    engine.copy_to_device(device.data(), expected.data(), bytes, 4);
    engine.synchronize();
    CHECK(f.sim.queued_operations(4) == 0);
  }
}

TEST_CASE("staged_copy: with immediate completion nothing waits", "[staged_copy]") {
  fixture f(immediate());
  staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 2));
  const std::vector<unsigned char> expected = pattern(5_MiB + 3, 12);
  std::vector<unsigned char> device(expected.size(), 0);
  engine.copy_to_device(device.data(), expected.data(), expected.size(), 1);
  CHECK(first_difference(device, expected) == -1);
  CHECK(engine.counters().slot_waits == 0);
}

TEST_CASE("staged_copy: concurrent copies through one engine take turns", "[staged_copy]") {
  fixture f(immediate());
  staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 3));
  std::vector<std::thread> threads;
  std::vector<int> failures(3, 0);
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        const std::vector<unsigned char> expected =
            pattern(2_MiB + static_cast<std::size_t>(round) * 4099, static_cast<unsigned>(t * 10 + round));
        std::vector<unsigned char> device(expected.size(), 0);
        engine.copy_to_device(device.data(), expected.data(), expected.size(), static_cast<stream_handle>(t + 1));
        if (first_difference(device, expected) != -1) ++failures[static_cast<std::size_t>(t)];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(failures == std::vector<int>{0, 0, 0});
}

TEST_CASE("staged_copy: failures are reported and leave the engine usable", "[staged_copy]") {
  fixture f;
  staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 2));
  const std::vector<unsigned char> expected = pattern(6_MiB, 13);
  std::vector<unsigned char> device(expected.size(), 0);

  SECTION("a refused DMA") {
    f.sim.fail_nth(sim_host_fault_point::copy_to_device, 3, status_code::device_error);
    REQUIRE_THROWS_AS(engine.copy_to_device(device.data(), expected.data(), expected.size(), 1), device_failure);
  }
  SECTION("a refused record waits for the device before reporting") {
    f.sim.fail_nth(sim_host_fault_point::record_event, 2, status_code::device_error);
    REQUIRE_THROWS_AS(engine.copy_to_device(device.data(), expected.data(), expected.size(), 1), device_failure);
    CHECK(f.sim.counters().device_syncs == 1);
  }
  SECTION("a refused wait for a slot") {
    f.sim.fail_nth(sim_host_fault_point::synchronize_event, 1, status_code::device_error);
    REQUIRE_THROWS_AS(engine.copy_to_device(device.data(), expected.data(), expected.size(), 1), device_failure);
  }
  f.sim.complete_all();
  std::fill(device.begin(), device.end(), 0);
  engine.copy_to_device(device.data(), expected.data(), expected.size(), 1);
  f.sim.complete_all();
  CHECK(first_difference(device, expected) == -1);
  CHECK(f.sim.counters().stale_copies == 0);
}

TEST_CASE("staged_copy: staging that cannot be pinned fails cleanly", "[staged_copy]") {
  pinned_pool_config small;
  small.capacity_bytes = 3_MiB;
  fixture f({}, small);
  std::vector<unsigned char> device(4_MiB), src(4_MiB);

  SECTION("the capacity cannot hold the ring") {
    staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB + 512_KiB, 3));
    REQUIRE_THROWS_AS(engine.copy_to_device(device.data(), src.data(), src.size(), 1), pinned_out_of_memory);
  }
  SECTION("events cannot be created") {
    staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 2));
    f.sim.fail_nth(sim_host_fault_point::create_event, 2, status_code::device_error);
    REQUIRE_THROWS_AS(engine.copy_to_device(device.data(), src.data(), src.size(), 1), device_failure);
  }
  CHECK(f.pool.stats().active_requests.current == 0);
  CHECK(f.sim.live_events() == 0);
  CHECK_NOTHROW(f.pool.validate());
}

TEST_CASE("staged_copy: bad ring shapes are usage errors", "[staged_copy]") {
  fixture f;
  REQUIRE_THROWS_AS(staged_copy_engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 1)), usage_error);
  REQUIRE_THROWS_AS(staged_copy_engine(f.sim, f.pool, f.workers, 0, ring(0, 2)), usage_error);
}

TEST_CASE("staged_copy: destruction waits for DMAs in flight and returns the slots", "[staged_copy]") {
  fixture f;
  const std::vector<unsigned char> expected = pattern(5_MiB, 14);
  std::vector<unsigned char> device(expected.size(), 0);
  {
    staged_copy_engine engine(f.sim, f.pool, f.workers, 0, ring(1_MiB, 4));
    engine.copy_to_device(device.data(), expected.data(), expected.size(), 2);
    CHECK(f.sim.queued_operations(2) > 0);
  }
  CHECK(f.sim.queued_operations(2) == 0);
  CHECK(first_difference(device, expected) == -1);
  CHECK(f.pool.stats().active_requests.current == 0);
  CHECK(f.sim.live_events() == 0);
  f.pool.trim();
  CHECK(f.sim.counters().stale_copies == 0);
  CHECK_NOTHROW(f.pool.validate());
}
