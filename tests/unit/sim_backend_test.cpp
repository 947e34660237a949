// Tests of sim_backend, the CPU device model every policy test relies on:
// addresses, capacity, events, virtual memory, touched work, faults, misuse.
// Also covers the util error text (status names, format_bytes, OOM message).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
void* ptr(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

sim_config manual_events() {
  sim_config config;
  config.events_complete_immediately = false;
  return config;
}

void* must_allocate(sim_backend& backend, std::size_t bytes) {
  void* p = nullptr;
  const status s = backend.allocate_segment(bytes, &p);
  INFO(s.message());
  REQUIRE(s.ok());
  return p;
}

event_handle must_create_event(sim_backend& backend) {
  event_handle event = 0;
  REQUIRE(backend.create_event(&event).ok());
  return event;
}

void* must_reserve(sim_backend& backend, std::size_t bytes) {
  void* range = nullptr;
  const status s = backend.vm_reserve(bytes, &range);
  INFO(s.message());
  REQUIRE(s.ok());
  return range;
}

physical_handle must_create_chunk(sim_backend& backend, std::size_t bytes) {
  physical_handle chunk = 0;
  const status s = backend.vm_create(bytes, &chunk);
  INFO(s.message());
  REQUIRE(s.ok());
  return chunk;
}

bool query_done(sim_backend& backend, event_handle event) {
  bool done = false;
  REQUIRE(backend.query_event(event, &done).ok());
  return done;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool is_pending(const sim_backend& backend, event_handle event) {
  const auto pending = backend.pending_events();
  return std::find(pending.begin(), pending.end(), event) != pending.end();
}

}  // namespace

TEST_CASE("sim_backend: segments get unique, aligned, never-adjacent addresses", "[sim_backend]") {
  sim_backend backend;
  std::vector<std::pair<void*, std::size_t>> segments;
  const std::size_t sizes[] = {512, 2_MiB, 2_MiB + 1, 20_MiB, 3_MiB, 4096};
  for (std::size_t bytes : sizes) segments.emplace_back(must_allocate(backend, bytes), bytes);

  for (std::size_t i = 0; i < segments.size(); ++i) {
    CAPTURE(i);
    CHECK(addr(segments[i].first) != 0);
    CHECK(addr(segments[i].first) % 2_MiB == 0);
    for (std::size_t j = 0; j < segments.size(); ++j) {
      if (i == j) continue;
      const std::uintptr_t a = addr(segments[i].first);
      const std::uintptr_t b = addr(segments[j].first);
      // Disjoint and not touching: the end of one is never the start of another.
      CHECK((a + segments[i].second < b || b + segments[j].second < a));
    }
  }
  CHECK(backend.live_segments() == segments.size());

  // A freed address is never handed out again.
  void* first = segments[0].first;
  REQUIRE(backend.free_segment(first, segments[0].second).ok());
  for (int i = 0; i < 8; ++i) CHECK(must_allocate(backend, 512) != first);
}

TEST_CASE("sim_backend: capacity accounting and memory_info", "[sim_backend]") {
  sim_config config;
  config.capacity_bytes = 10_MiB;
  sim_backend backend(config);

  device_memory_info info;
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.total_bytes == 10_MiB);
  CHECK(info.free_bytes == 10_MiB);

  void* a = must_allocate(backend, 4_MiB);
  void* b = must_allocate(backend, 6_MiB);  // exactly fills the device
  CHECK(backend.used_bytes() == 10_MiB);
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.free_bytes == 0);

  void* c = nullptr;
  const status full = backend.allocate_segment(1, &c);
  CHECK(full.code() == status_code::out_of_memory);
  CHECK(c == nullptr);
  CHECK(backend.live_segments() == 2);
  CHECK(backend.used_bytes() == 10_MiB);

  REQUIRE(backend.free_segment(a, 4_MiB).ok());
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.free_bytes == 4_MiB);
  CHECK(backend.allocate_segment(4_MiB + 1, &c).code() == status_code::out_of_memory);
  c = must_allocate(backend, 4_MiB);

  auto counters = backend.counters();
  CHECK(counters.segment_allocs == 3);
  CHECK(counters.segment_frees == 1);

  REQUIRE(backend.free_segment(b, 6_MiB).ok());
  REQUIRE(backend.free_segment(c, 4_MiB).ok());
  CHECK(backend.used_bytes() == 0);
  CHECK(backend.live_segments() == 0);
}

TEST_CASE("sim_backend: set_capacity models memory taken by others", "[sim_backend]") {
  sim_config config;
  config.capacity_bytes = 8_MiB;
  sim_backend backend(config);
  void* a = must_allocate(backend, 6_MiB);

  backend.set_capacity(4_MiB);  // below what is in use
  CHECK(backend.capacity_bytes() == 4_MiB);
  device_memory_info info;
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.total_bytes == 4_MiB);
  CHECK(info.free_bytes == 0);
  void* b = nullptr;
  CHECK(backend.allocate_segment(512, &b).code() == status_code::out_of_memory);
  physical_handle chunk = 0;
  CHECK(backend.vm_create(2_MiB, &chunk).code() == status_code::out_of_memory);

  backend.set_capacity(16_MiB);
  b = must_allocate(backend, 10_MiB);
  REQUIRE(backend.free_segment(a, 6_MiB).ok());
  REQUIRE(backend.free_segment(b, 10_MiB).ok());
}

TEST_CASE("sim_backend: segment misuse is rejected without effect", "[sim_backend]") {
  sim_backend backend;
  void* p = nullptr;
  CHECK(backend.allocate_segment(0, &p).code() == status_code::invalid_argument);
  CHECK(backend.allocate_segment(1_MiB, nullptr).code() == status_code::invalid_argument);
  CHECK(backend.memory_info(nullptr).code() == status_code::invalid_argument);
  CHECK(backend.live_segments() == 0);

  void* a = must_allocate(backend, 4_MiB);
  SECTION("wrong size") {
    const status s = backend.free_segment(a, 2_MiB);
    CHECK(s.code() == status_code::invalid_argument);
    CHECK(contains(s.message(), "freed with"));
    CHECK(backend.live_segments() == 1);
  }
  SECTION("interior pointer") {
    CHECK(backend.free_segment(ptr(addr(a) + 512), 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.live_segments() == 1);
  }
  SECTION("null and foreign pointers") {
    CHECK(backend.free_segment(nullptr, 4_MiB).code() == status_code::invalid_argument);
    int local = 0;
    CHECK(backend.free_segment(&local, sizeof(local)).code() == status_code::invalid_argument);
    CHECK(backend.live_segments() == 1);
  }
  SECTION("double free") {
    REQUIRE(backend.free_segment(a, 4_MiB).ok());
    CHECK(backend.free_segment(a, 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.used_bytes() == 0);
    CHECK(backend.counters().segment_frees == 1);
  }
}

TEST_CASE("sim_backend: is_device_memory covers live segments only", "[sim_backend]") {
  sim_backend backend;
  void* a = must_allocate(backend, 4_MiB);
  const std::uintptr_t base = addr(a);
  CHECK(backend.is_device_memory(a, 4_MiB));
  CHECK(backend.is_device_memory(ptr(base + 1_MiB), 3_MiB));
  CHECK(backend.is_device_memory(ptr(base + 4_MiB - 1), 1));
  CHECK(backend.is_device_memory(ptr(base + 4_MiB - 1), 0));
  CHECK_FALSE(backend.is_device_memory(ptr(base + 1_MiB), 3_MiB + 1));
  CHECK_FALSE(backend.is_device_memory(ptr(base + 4_MiB), 1));
  CHECK_FALSE(backend.is_device_memory(ptr(base - 1), 2));
  CHECK_FALSE(backend.is_device_memory(nullptr, 1));
  CHECK_FALSE(backend.is_device_memory(ptr(base), SIZE_MAX));
  REQUIRE(backend.free_segment(a, 4_MiB).ok());
  CHECK_FALSE(backend.is_device_memory(a, 1));
}

TEST_CASE("sim_backend: streams are fresh and non-zero", "[sim_backend]") {
  sim_backend backend;
  std::vector<stream_handle> streams;
  for (int i = 0; i < 16; ++i) streams.push_back(backend.new_stream());
  std::sort(streams.begin(), streams.end());
  CHECK(std::adjacent_find(streams.begin(), streams.end()) == streams.end());
  CHECK(streams.front() != 0);
}

TEST_CASE("sim_backend: events complete immediately by default", "[sim_backend][events]") {
  sim_backend backend;
  const stream_handle stream = backend.new_stream();
  const event_handle event = must_create_event(backend);
  CHECK(backend.live_events() == 1);
  REQUIRE(backend.record_event(event, stream).ok());
  CHECK(query_done(backend, event));
  CHECK(backend.pending_events().empty());
  // Waiting on finished work is no hand-off.
  const stream_handle waiter = backend.new_stream();
  REQUIRE(backend.stream_wait_event(waiter, event).ok());
  CHECK_FALSE(backend.stream_waited_on(waiter, event));
  REQUIRE(backend.destroy_event(event).ok());
  CHECK(backend.live_events() == 0);
  const auto counters = backend.counters();
  CHECK(counters.events_created == 1);
  CHECK(counters.events_destroyed == 1);
  CHECK(counters.event_records == 1);
  CHECK(counters.event_queries == 1);
  CHECK(counters.stream_waits == 1);
}

TEST_CASE("sim_backend: test-controlled event completion", "[sim_backend][events]") {
  sim_backend backend(manual_events());
  const stream_handle s1 = backend.new_stream();
  const stream_handle s2 = backend.new_stream();
  const event_handle a = must_create_event(backend);
  const event_handle b = must_create_event(backend);
  const event_handle c = must_create_event(backend);

  SECTION("a never-recorded event reports done") {
    CHECK(query_done(backend, a));
    CHECK(backend.pending_events().empty());
    REQUIRE(backend.synchronize_event(a).ok());
  }

  SECTION("records stay pending, listed oldest first, until completed in any order") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s2).ok());
    REQUIRE(backend.record_event(c, 0).ok());  // the default stream
    CHECK(backend.pending_events() == std::vector<event_handle>{a, b, c});
    CHECK_FALSE(query_done(backend, a));
    backend.complete_event(b);
    CHECK(query_done(backend, b));
    CHECK_FALSE(query_done(backend, a));
    CHECK(backend.pending_events() == std::vector<event_handle>{a, c});
    backend.complete_event(c);
    backend.complete_event(a);
    CHECK(backend.pending_events().empty());
    backend.complete_event(a);  // completing a finished event changes nothing
    CHECK(query_done(backend, a));
  }

  SECTION("re-recording replaces the previous record") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s1).ok());
    backend.complete_event(a);
    CHECK(query_done(backend, a));
    REQUIRE(backend.record_event(a, s2).ok());  // pending again, now the newest
    CHECK_FALSE(query_done(backend, a));
    CHECK(backend.pending_events() == std::vector<event_handle>{b, a});
    backend.complete_stream(s1);  // the old record on s1 no longer exists
    CHECK_FALSE(query_done(backend, a));
    CHECK(query_done(backend, b));
    backend.complete_stream(s2);
    CHECK(query_done(backend, a));
  }

  SECTION("complete_stream completes that stream only") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s2).ok());
    REQUIRE(backend.record_event(c, s1).ok());
    backend.complete_stream(s1);
    CHECK(backend.pending_events() == std::vector<event_handle>{b});
  }

  SECTION("synchronize_event completes that event only") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s1).ok());
    REQUIRE(backend.synchronize_event(b).ok());
    CHECK(query_done(backend, b));
    CHECK_FALSE(query_done(backend, a));
    CHECK(backend.counters().event_syncs == 1);
  }

  SECTION("synchronize_device and complete_all_events complete everything") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s2).ok());
    REQUIRE(backend.synchronize_device().ok());
    CHECK(backend.pending_events().empty());
    CHECK(backend.counters().device_syncs == 1);
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(c, s2).ok());
    backend.complete_all_events();
    CHECK(backend.pending_events().empty());
  }

  SECTION("destroying a pending event drops it from the pending list") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s1).ok());
    REQUIRE(backend.destroy_event(a).ok());
    CHECK(backend.pending_events() == std::vector<event_handle>{b});
    CHECK(backend.live_events() == 2);
  }
}

TEST_CASE("sim_backend: stream waits record hand-offs of pending work", "[sim_backend][events]") {
  sim_backend backend(manual_events());
  const stream_handle producer = backend.new_stream();
  const stream_handle consumer = backend.new_stream();
  const stream_handle other = backend.new_stream();
  const event_handle event = must_create_event(backend);
  const event_handle never_recorded = must_create_event(backend);

  REQUIRE(backend.stream_wait_event(consumer, never_recorded).ok());
  CHECK_FALSE(backend.stream_waited_on(consumer, never_recorded));

  REQUIRE(backend.record_event(event, producer).ok());
  CHECK_FALSE(backend.stream_waited_on(consumer, event));
  REQUIRE(backend.stream_wait_event(consumer, event).ok());
  CHECK(backend.stream_waited_on(consumer, event));
  CHECK_FALSE(backend.stream_waited_on(other, event));
  CHECK_FALSE(backend.stream_waited_on(producer, event));
  // The wait orders the device; it completes nothing on the host side.
  CHECK_FALSE(query_done(backend, event));

  backend.complete_event(event);
  REQUIRE(backend.stream_wait_event(other, event).ok());
  CHECK_FALSE(backend.stream_waited_on(other, event));
  CHECK(backend.stream_waited_on(consumer, event));  // history is kept
  CHECK(backend.counters().stream_waits == 3);

  // The default stream can wait too.
  REQUIRE(backend.record_event(event, producer).ok());
  REQUIRE(backend.stream_wait_event(0, event).ok());
  CHECK(backend.stream_waited_on(0, event));
}

TEST_CASE("sim_backend: unknown event and stream handles are rejected", "[sim_backend][events]") {
  sim_backend backend(manual_events());
  const stream_handle stream = backend.new_stream();
  const event_handle event = must_create_event(backend);
  const event_handle bogus_event = event + 1000;
  const stream_handle bogus_stream = stream + 1000;
  bool done = true;

  CHECK(backend.create_event(nullptr).code() == status_code::invalid_argument);
  CHECK(backend.destroy_event(bogus_event).code() == status_code::invalid_argument);
  CHECK(backend.record_event(bogus_event, stream).code() == status_code::invalid_argument);
  CHECK(backend.record_event(event, bogus_stream).code() == status_code::invalid_argument);
  // Swapped arguments: an event handle is never a valid stream and vice versa.
  CHECK(backend.record_event(stream, event).code() == status_code::invalid_argument);
  CHECK(backend.query_event(bogus_event, &done).code() == status_code::invalid_argument);
  CHECK(done);
  CHECK(backend.query_event(event, nullptr).code() == status_code::invalid_argument);
  CHECK(backend.synchronize_event(bogus_event).code() == status_code::invalid_argument);
  CHECK(backend.stream_wait_event(bogus_stream, event).code() == status_code::invalid_argument);
  CHECK(backend.stream_wait_event(stream, bogus_event).code() == status_code::invalid_argument);
  CHECK(backend.pending_events().empty());

  REQUIRE(backend.destroy_event(event).ok());
  CHECK(backend.destroy_event(event).code() == status_code::invalid_argument);
  CHECK(backend.record_event(event, stream).code() == status_code::invalid_argument);
  // Test controls ignore unknown handles instead of failing.
  backend.complete_event(bogus_event);
  backend.complete_stream(bogus_stream);
  CHECK_FALSE(backend.stream_waited_on(bogus_stream, bogus_event));

  const auto counters = backend.counters();
  CHECK(counters.events_created == 1);
  CHECK(counters.events_destroyed == 1);
  CHECK(counters.event_records == 0);
  CHECK(counters.event_queries == 0);
  CHECK(counters.event_syncs == 0);
  CHECK(counters.stream_waits == 0);
}

TEST_CASE("sim_backend: virtual memory can be switched off", "[sim_backend][vm]") {
  sim_config config;
  config.virtual_memory = false;
  sim_backend backend(config);
  CHECK_FALSE(backend.supports_virtual_memory());
  void* range = nullptr;
  physical_handle chunk = 0;
  CHECK(backend.vm_reserve(2_MiB, &range).code() == status_code::not_supported);
  CHECK(backend.vm_release(range, 2_MiB).code() == status_code::not_supported);
  CHECK(backend.vm_create(2_MiB, &chunk).code() == status_code::not_supported);
  CHECK(backend.vm_destroy(chunk).code() == status_code::not_supported);
  CHECK(backend.vm_map(range, 2_MiB, chunk).code() == status_code::not_supported);
  CHECK(backend.vm_unmap(range, 2_MiB).code() == status_code::not_supported);
  CHECK(backend.used_bytes() == 0);
}

TEST_CASE("sim_backend: a non-power-of-two granularity is a bad config", "[sim_backend][vm]") {
  sim_config config;
  config.vm_granularity_bytes = 3_MiB;
  REQUIRE_THROWS_AS(sim_backend(config), std::invalid_argument);
  config.vm_granularity_bytes = 0;
  REQUIRE_THROWS_AS(sim_backend(config), std::invalid_argument);
  config.virtual_memory = false;  // ignored when virtual memory is off
  REQUIRE_NOTHROW(sim_backend(config));
}

TEST_CASE("sim_backend: reserve, create, map, unmap, release", "[sim_backend][vm]") {
  sim_config config;
  config.capacity_bytes = 16_MiB;
  sim_backend backend(config);
  REQUIRE(backend.supports_virtual_memory());
  REQUIRE(backend.vm_granularity() == 2_MiB);

  void* segment = must_allocate(backend, 2_MiB);
  // Address space is not device memory: a reservation far beyond capacity works.
  void* range = must_reserve(backend, 1_GiB);
  const std::uintptr_t base = addr(range);
  CHECK(base % 2_MiB == 0);
  CHECK((base > addr(segment) + 2_MiB || base + 1_GiB < addr(segment)));
  CHECK(backend.used_bytes() == 2_MiB);
  CHECK(backend.live_ranges() == 1);
  CHECK_FALSE(backend.is_device_memory(range, 1));

  const physical_handle c1 = must_create_chunk(backend, 4_MiB);
  const physical_handle c2 = must_create_chunk(backend, 2_MiB);
  CHECK(c1 != c2);
  CHECK(backend.used_bytes() == 8_MiB);
  CHECK(backend.live_chunks() == 2);
  CHECK(backend.mapped_chunks() == 0);

  REQUIRE(backend.vm_map(range, 4_MiB, c1).ok());
  REQUIRE(backend.vm_map(ptr(base + 4_MiB), 2_MiB, c2).ok());
  CHECK(backend.mapped_chunks() == 2);
  // Contiguous mappings read as one span of device memory.
  CHECK(backend.is_device_memory(range, 6_MiB));
  CHECK(backend.is_device_memory(ptr(base + 3_MiB), 2_MiB));
  CHECK_FALSE(backend.is_device_memory(range, 6_MiB + 1));
  CHECK_FALSE(backend.is_device_memory(ptr(base + 6_MiB), 1));

  REQUIRE(backend.vm_unmap(range, 4_MiB).ok());
  CHECK_FALSE(backend.is_device_memory(range, 1));
  CHECK(backend.is_device_memory(ptr(base + 4_MiB), 2_MiB));
  REQUIRE(backend.vm_destroy(c1).ok());
  CHECK(backend.used_bytes() == 4_MiB);
  REQUIRE(backend.vm_unmap(ptr(base + 4_MiB), 2_MiB).ok());
  REQUIRE(backend.vm_destroy(c2).ok());
  REQUIRE(backend.vm_release(range, 1_GiB).ok());
  CHECK(backend.live_ranges() == 0);
  CHECK(backend.live_chunks() == 0);
  CHECK(backend.used_bytes() == 2_MiB);

  const auto counters = backend.counters();
  CHECK(counters.vm_maps == 2);
  CHECK(counters.vm_unmaps == 2);
}

TEST_CASE("sim_backend: physical chunks count against capacity", "[sim_backend][vm]") {
  sim_config config;
  config.capacity_bytes = 8_MiB;
  sim_backend backend(config);
  const physical_handle c1 = must_create_chunk(backend, 6_MiB);
  physical_handle c2 = 0;
  CHECK(backend.vm_create(4_MiB, &c2).code() == status_code::out_of_memory);
  void* segment = nullptr;
  CHECK(backend.allocate_segment(4_MiB, &segment).code() == status_code::out_of_memory);
  c2 = must_create_chunk(backend, 2_MiB);
  device_memory_info info;
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.free_bytes == 0);
  REQUIRE(backend.vm_destroy(c1).ok());
  REQUIRE(backend.memory_info(&info).ok());
  CHECK(info.free_bytes == 6_MiB);
  REQUIRE(backend.vm_destroy(c2).ok());
  CHECK(backend.used_bytes() == 0);
}

TEST_CASE("sim_backend: a coarse granularity aligns ranges", "[sim_backend][vm]") {
  sim_config config;
  config.vm_granularity_bytes = 8_MiB;
  sim_backend backend(config);
  void* range = nullptr;
  CHECK(backend.vm_reserve(2_MiB, &range).code() == status_code::invalid_argument);
  void* segment = must_allocate(backend, 1_MiB);
  void* r1 = must_reserve(backend, 8_MiB);
  void* r2 = must_reserve(backend, 16_MiB);
  CHECK(addr(r1) % 8_MiB == 0);
  CHECK(addr(r2) % 8_MiB == 0);
  CHECK(addr(segment) % 2_MiB == 0);
  CHECK(addr(r1) + 8_MiB < addr(r2));
  physical_handle chunk = 0;
  CHECK(backend.vm_create(2_MiB, &chunk).code() == status_code::invalid_argument);
  chunk = must_create_chunk(backend, 8_MiB);
  CHECK(backend.vm_map(ptr(addr(r2) + 2_MiB), 8_MiB, chunk).code() == status_code::invalid_argument);
  REQUIRE(backend.vm_map(ptr(addr(r2) + 8_MiB), 8_MiB, chunk).ok());
}

TEST_CASE("sim_backend: virtual-memory misuse is rejected without effect", "[sim_backend][vm]") {
  sim_backend backend;
  void* range = must_reserve(backend, 8_MiB);
  const std::uintptr_t base = addr(range);
  const physical_handle c4 = must_create_chunk(backend, 4_MiB);
  const physical_handle c2 = must_create_chunk(backend, 2_MiB);
  void* segment = must_allocate(backend, 4_MiB);
  const std::size_t used = backend.used_bytes();

  SECTION("reserve and create sizes") {
    void* r = nullptr;
    physical_handle c = 0;
    CHECK(backend.vm_reserve(0, &r).code() == status_code::invalid_argument);
    CHECK(backend.vm_reserve(3_MiB, &r).code() == status_code::invalid_argument);
    CHECK(backend.vm_reserve(2_MiB, nullptr).code() == status_code::invalid_argument);
    CHECK(backend.vm_create(0, &c).code() == status_code::invalid_argument);
    CHECK(backend.vm_create(1_MiB, &c).code() == status_code::invalid_argument);
    CHECK(backend.vm_create(2_MiB, nullptr).code() == status_code::invalid_argument);
    CHECK(backend.live_ranges() == 1);
    CHECK(backend.live_chunks() == 2);
  }

  SECTION("map outside any reserved range") {
    CHECK(backend.vm_map(segment, 2_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(ptr(base + 8_MiB), 2_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(nullptr, 2_MiB, c2).code() == status_code::invalid_argument);
  }

  SECTION("map misaligned, past the range end, or with the wrong size") {
    CHECK(backend.vm_map(ptr(base + 1_MiB), 2_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(ptr(base + 6_MiB), 4_MiB, c4).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(range, 2_MiB, c4).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(range, 4_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(range, 2_MiB, c2 + 1000).code() == status_code::invalid_argument);
  }

  SECTION("map over an existing mapping or a chunk twice") {
    REQUIRE(backend.vm_map(ptr(base + 2_MiB), 4_MiB, c4).ok());
    const physical_handle c2b = must_create_chunk(backend, 2_MiB);
    CHECK(backend.vm_map(ptr(base + 2_MiB), 2_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(ptr(base + 4_MiB), 2_MiB, c2).code() == status_code::invalid_argument);
    CHECK(backend.vm_map(ptr(base + 6_MiB), 4_MiB, c4).code() == status_code::invalid_argument);
    const physical_handle c4b = must_create_chunk(backend, 4_MiB);
    CHECK(backend.vm_map(range, 4_MiB, c4b).code() == status_code::invalid_argument);  // overlaps [2, 6)
    REQUIRE(backend.vm_map(range, 2_MiB, c2).ok());
    REQUIRE(backend.vm_map(ptr(base + 6_MiB), 2_MiB, c2b).ok());
    CHECK(backend.mapped_chunks() == 3);
    CHECK(backend.is_device_memory(range, 8_MiB));
    CHECK(backend.counters().vm_maps == 3);
  }

  SECTION("unmap must name an exact mapping") {
    REQUIRE(backend.vm_map(ptr(base + 2_MiB), 4_MiB, c4).ok());
    CHECK(backend.vm_unmap(ptr(base + 2_MiB), 2_MiB).code() == status_code::invalid_argument);
    CHECK(backend.vm_unmap(ptr(base + 4_MiB), 2_MiB).code() == status_code::invalid_argument);
    CHECK(backend.vm_unmap(range, 2_MiB).code() == status_code::invalid_argument);
    CHECK(backend.vm_unmap(segment, 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.mapped_chunks() == 1);
    CHECK(backend.counters().vm_unmaps == 0);
    REQUIRE(backend.vm_unmap(ptr(base + 2_MiB), 4_MiB).ok());
    CHECK(backend.vm_unmap(ptr(base + 2_MiB), 4_MiB).code() == status_code::invalid_argument);
  }

  SECTION("release needs the exact range and no mappings") {
    REQUIRE(backend.vm_map(range, 2_MiB, c2).ok());
    CHECK(backend.vm_release(range, 8_MiB).code() == status_code::invalid_argument);
    REQUIRE(backend.vm_unmap(range, 2_MiB).ok());
    CHECK(backend.vm_release(range, 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.vm_release(ptr(base + 2_MiB), 6_MiB).code() == status_code::invalid_argument);
    CHECK(backend.vm_release(segment, 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.live_ranges() == 1);
    REQUIRE(backend.vm_release(range, 8_MiB).ok());
    CHECK(backend.vm_release(range, 8_MiB).code() == status_code::invalid_argument);
    // Mapping into a released range fails.
    CHECK(backend.vm_map(range, 2_MiB, c2).code() == status_code::invalid_argument);
  }

  SECTION("destroy needs a known, unmapped chunk") {
    REQUIRE(backend.vm_map(range, 4_MiB, c4).ok());
    CHECK(backend.vm_destroy(c4).code() == status_code::invalid_argument);
    CHECK(backend.used_bytes() == used);
    CHECK(backend.vm_destroy(c4 + 1000).code() == status_code::invalid_argument);
    REQUIRE(backend.vm_unmap(range, 4_MiB).ok());
    REQUIRE(backend.vm_destroy(c4).ok());
    CHECK(backend.vm_destroy(c4).code() == status_code::invalid_argument);
    CHECK(backend.used_bytes() == used - 4_MiB);
    CHECK(backend.vm_map(range, 4_MiB, c4).code() == status_code::invalid_argument);
  }

  SECTION("a segment is not a range") {
    CHECK(backend.free_segment(range, 8_MiB).code() == status_code::invalid_argument);
    CHECK(backend.live_ranges() == 1);
  }
}

namespace {

// A reserved range of `chunks` + 1 granules with the first `chunks` mapped
// back to back, 2 MiB each; the last granule stays unmapped.
void* map_chunks(sim_backend& backend, std::size_t chunks) {
  void* range = must_reserve(backend, (chunks + 1) * 2_MiB);
  for (std::size_t i = 0; i < chunks; ++i) {
    REQUIRE(backend.vm_map(ptr(addr(range) + i * 2_MiB), 2_MiB, must_create_chunk(backend, 2_MiB)).ok());
  }
  return range;
}

void* chunk_at(void* range, std::size_t index) { return ptr(addr(range) + index * 2_MiB); }

status unmap_chunk(sim_backend& backend, void* range, std::size_t index) {
  return backend.vm_unmap(chunk_at(range, index), 2_MiB);
}

std::string hex_of(const void* p) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "0x%llx", static_cast<unsigned long long>(addr(p)));
  return buffer;
}

}  // namespace

TEST_CASE("sim_backend: unmapping touched memory fails until the stream's work is known done",
          "[sim_backend][vm][touch]") {
  sim_backend backend(manual_events());
  const stream_handle s1 = backend.new_stream();
  const stream_handle s2 = backend.new_stream();
  void* range = map_chunks(backend, 2);
  const event_handle a = must_create_event(backend);
  const event_handle b = must_create_event(backend);

  backend.touch(s1, ptr(addr(range) + 1_MiB), 4096);
  CHECK(backend.live_touches() == 1);
  const status refused = unmap_chunk(backend, range, 0);
  CHECK(refused.code() == status_code::device_error);
  CHECK(refused.message() == "sim_backend: vm_unmap: [" + hex_of(range) + ", +2097152) may still be in use by stream " +
                                 std::to_string(s1) + " (touched, no completed event recorded since)");
  CHECK(backend.is_device_memory(range, 4_MiB));  // the mapping stays
  CHECK(backend.mapped_chunks() == 2);
  CHECK(backend.counters().unsafe_unmaps == 1);
  CHECK(backend.counters().vm_unmaps == 0);
  // The untouched neighbour unmaps.
  REQUIRE(unmap_chunk(backend, range, 1).ok());

  SECTION("a record on the stream after the touch retires it once complete") {
    REQUIRE(backend.record_event(a, s1).ok());
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
    CHECK(backend.live_touches() == 1);
    backend.complete_event(a);
    CHECK(backend.live_touches() == 0);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
    CHECK_FALSE(backend.is_device_memory(range, 1));
    CHECK(backend.counters().unsafe_unmaps == 2);
    CHECK(backend.counters().vm_unmaps == 2);
  }

  SECTION("a completed record on another stream does not") {
    REQUIRE(backend.record_event(a, s2).ok());
    backend.complete_event(a);
    REQUIRE(backend.record_event(b, 0).ok());  // nor one on the default stream
    backend.complete_event(b);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
    CHECK(backend.live_touches() == 1);
  }

  SECTION("a record made before the touch does not cover it") {
    void* other = map_chunks(backend, 1);
    REQUIRE(backend.record_event(a, s1).ok());
    backend.touch(s1, other, 2_MiB);
    backend.complete_event(a);
    CHECK(backend.live_touches() == 1);
    REQUIRE(unmap_chunk(backend, range, 0).ok());  // touched before a's record
    CHECK(unmap_chunk(backend, other, 0).code() == status_code::device_error);
  }

  SECTION("a newer record completing retires older work on its stream") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s1).ok());
    backend.complete_event(b);
    CHECK_FALSE(query_done(backend, a));  // events still complete one by one
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("a record replaced by re-recording never covers the touch") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(a, s2).ok());
    backend.complete_event(a);
    backend.complete_stream(s1);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
    REQUIRE(backend.record_event(b, s1).ok());
    backend.complete_stream(s1);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("synchronize_event retires") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.synchronize_event(a).ok());
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("complete_stream retires work up to the stream's last record") {
    REQUIRE(backend.record_event(a, s1).ok());
    void* other = map_chunks(backend, 1);
    backend.touch(s1, other, 2_MiB);  // after the last record
    backend.complete_stream(s2);
    CHECK(backend.live_touches() == 2);
    backend.complete_stream(s1);
    CHECK(backend.live_touches() == 1);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
    CHECK(unmap_chunk(backend, other, 0).code() == status_code::device_error);
  }

  SECTION("complete_all_events retires") {
    REQUIRE(backend.record_event(a, s1).ok());
    REQUIRE(backend.record_event(b, s2).ok());
    backend.complete_all_events();
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("synchronize_device retires every touch, recorded after or not") {
    void* other = map_chunks(backend, 1);
    backend.touch(s2, other, 2_MiB);
    backend.touch(0, other, 1_MiB);
    CHECK(backend.live_touches() == 3);
    REQUIRE(backend.synchronize_device().ok());
    CHECK(backend.live_touches() == 0);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
    REQUIRE(unmap_chunk(backend, other, 0).ok());
    // Later touches count again.
    REQUIRE(backend.vm_map(range, 2_MiB, must_create_chunk(backend, 2_MiB)).ok());
    backend.touch(s1, range, 2_MiB);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  }

  SECTION("a failed synchronize_device retires nothing") {
    backend.fail_nth(sim_fault_point::synchronize_device, 1, status_code::device_error);
    CHECK(backend.synchronize_device().code() == status_code::device_error);
    CHECK(backend.live_touches() == 1);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  }

  SECTION("an injected fault and misuse are reported before the touch") {
    backend.fail_nth(sim_fault_point::vm_unmap, 1, status_code::no_device);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::no_device);
    CHECK(backend.vm_unmap(range, 4_MiB).code() == status_code::invalid_argument);
    CHECK(backend.counters().unsafe_unmaps == 1);
    CHECK(backend.is_device_memory(range, 2_MiB));
  }
}

TEST_CASE("sim_backend: a completed record vouches for the records its stream waited on",
          "[sim_backend][vm][touch]") {
  // The cross-stream hand-off: the old stream records, the new one waits on
  // it, and later only the new stream is synchronized.
  sim_backend backend(manual_events());
  const stream_handle old_stream = backend.new_stream();
  const stream_handle new_stream = backend.new_stream();
  const stream_handle third = backend.new_stream();
  void* range = map_chunks(backend, 1);
  const event_handle handoff = must_create_event(backend);
  const event_handle later = must_create_event(backend);
  const event_handle last = must_create_event(backend);
  backend.touch(old_stream, range, 2_MiB);
  REQUIRE(backend.record_event(handoff, old_stream).ok());

  SECTION("a record after the wait covers the waited-on work") {
    REQUIRE(backend.stream_wait_event(new_stream, handoff).ok());
    REQUIRE(backend.record_event(later, new_stream).ok());
    backend.complete_event(later);
    CHECK_FALSE(query_done(backend, handoff));  // the event itself completes on its own
    CHECK(backend.live_touches() == 0);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("a record before the wait does not") {
    REQUIRE(backend.record_event(later, new_stream).ok());
    REQUIRE(backend.stream_wait_event(new_stream, handoff).ok());
    backend.complete_event(later);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
    REQUIRE(backend.record_event(last, new_stream).ok());
    REQUIRE(backend.synchronize_event(last).ok());
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("through a chain of waits") {
    REQUIRE(backend.stream_wait_event(new_stream, handoff).ok());
    REQUIRE(backend.record_event(later, new_stream).ok());
    REQUIRE(backend.stream_wait_event(third, later).ok());
    REQUIRE(backend.record_event(last, third).ok());
    backend.complete_stream(third);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
  }

  SECTION("a wait on a completed or re-recorded event carries nothing extra") {
    backend.complete_event(handoff);  // retires the touch by itself
    CHECK(backend.live_touches() == 0);
    backend.touch(old_stream, range, 2_MiB);
    REQUIRE(backend.stream_wait_event(new_stream, handoff).ok());  // waits on finished work only
    REQUIRE(backend.record_event(later, new_stream).ok());
    backend.complete_event(later);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  }

  SECTION("the waiting stream's other work is not vouched for by the waited one") {
    backend.touch(new_stream, range, 1_MiB);
    REQUIRE(backend.stream_wait_event(new_stream, handoff).ok());
    backend.complete_event(handoff);
    CHECK(backend.live_touches() == 1);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  }
}

TEST_CASE("sim_backend: with immediate events any later record on the stream retires a touch",
          "[sim_backend][vm][touch]") {
  sim_backend backend;
  const stream_handle s1 = backend.new_stream();
  const stream_handle s2 = backend.new_stream();
  void* range = map_chunks(backend, 1);
  const event_handle e = must_create_event(backend);
  REQUIRE(backend.record_event(e, s1).ok());  // before the touch: covers nothing
  backend.touch(s1, range, 2_MiB);
  CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  REQUIRE(backend.record_event(e, s2).ok());
  CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
  CHECK(backend.live_touches() == 1);
  REQUIRE(backend.record_event(e, s1).ok());
  CHECK(backend.live_touches() == 0);
  REQUIRE(unmap_chunk(backend, range, 0).ok());
  CHECK(backend.counters().unsafe_unmaps == 2);
}

TEST_CASE("sim_backend: only touches overlapping the unmapped memory block it", "[sim_backend][vm][touch]") {
  sim_backend backend(manual_events());
  const stream_handle s1 = backend.new_stream();
  const stream_handle s2 = backend.new_stream();
  void* range = map_chunks(backend, 4);
  void* segment = must_allocate(backend, 4_MiB);
  void* elsewhere = map_chunks(backend, 1);
  backend.touch(s2, segment, 4_MiB);
  backend.touch(s2, elsewhere, 2_MiB);
  backend.touch(s2, chunk_at(range, 4), 2_MiB);  // the unmapped tail granule

  SECTION("a touch of exactly one chunk blocks that chunk only") {
    backend.touch(s1, chunk_at(range, 1), 2_MiB);
    REQUIRE(unmap_chunk(backend, range, 0).ok());
    REQUIRE(unmap_chunk(backend, range, 2).ok());
    CHECK(unmap_chunk(backend, range, 1).code() == status_code::device_error);
  }

  SECTION("one byte of overlap at either edge blocks") {
    backend.touch(s1, ptr(addr(range) + 2_MiB - 1), 2);
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);
    CHECK(unmap_chunk(backend, range, 1).code() == status_code::device_error);
    REQUIRE(unmap_chunk(backend, range, 2).ok());
  }

  SECTION("a long touch blocks a chunk far from its start, among many small ones") {
    for (std::size_t i = 0; i < 1000; ++i) backend.touch(s2, ptr(addr(range) + i * 2048), 256);
    backend.touch(s1, range, 8_MiB);
    const status refused = unmap_chunk(backend, range, 3);
    CHECK(refused.code() == status_code::device_error);
    CHECK(contains(refused.message(), "stream " + std::to_string(s1) + " "));
    const event_handle e = must_create_event(backend);
    REQUIRE(backend.record_event(e, s1).ok());
    backend.complete_event(e);
    REQUIRE(unmap_chunk(backend, range, 3).ok());
    CHECK(unmap_chunk(backend, range, 0).code() == status_code::device_error);  // the small ones on s2
  }
  CHECK(backend.live_touches() >= 3);
}

TEST_CASE("sim_backend: freeing a segment or releasing a range drops its touches", "[sim_backend][vm][touch]") {
  sim_backend backend(manual_events());
  const stream_handle stream = backend.new_stream();
  void* freed = must_allocate(backend, 4_MiB);
  void* kept = must_allocate(backend, 4_MiB);
  void* released = must_reserve(backend, 8_MiB);
  void* mapped = map_chunks(backend, 1);
  backend.touch(stream, freed, 1_MiB);
  backend.touch(stream, ptr(addr(freed) + 3_MiB), 1_MiB);
  backend.touch(stream, kept, 4_MiB);
  backend.touch(stream, ptr(addr(released) + 2_MiB), 6_MiB);
  backend.touch(stream, mapped, 2_MiB);
  REQUIRE(backend.live_touches() == 5);

  // A free that fails does nothing, so it synchronizes nothing either.
  backend.fail_nth(sim_fault_point::free_segment, 1);
  CHECK_FALSE(backend.free_segment(freed, 4_MiB).ok());
  CHECK(backend.live_touches() == 5);

  REQUIRE(backend.free_segment(freed, 4_MiB).ok());
  CHECK(backend.live_touches() == 3);
  CHECK(backend.vm_release(released, 4_MiB).code() == status_code::invalid_argument);
  CHECK(backend.live_touches() == 3);
  REQUIRE(backend.vm_release(released, 8_MiB).ok());
  CHECK(backend.live_touches() == 2);
  CHECK(unmap_chunk(backend, mapped, 0).code() == status_code::device_error);
}

TEST_CASE("sim_backend: touch rejects unknown streams and memory the device does not hold",
          "[sim_backend][vm][touch]") {
  sim_backend backend(manual_events());
  const stream_handle stream = backend.new_stream();
  void* segment = must_allocate(backend, 4_MiB);
  void* range = must_reserve(backend, 4_MiB);
  int host = 0;

  REQUIRE_NOTHROW(backend.touch(stream, ptr(addr(segment) + 1_MiB), 3_MiB));
  REQUIRE_NOTHROW(backend.touch(0, range, 4_MiB));  // reserved, mapped or not
  REQUIRE_NOTHROW(backend.touch(stream, &host, 0));  // touches nothing
  CHECK(backend.live_touches() == 2);

  REQUIRE_THROWS_AS(backend.touch(stream + 1, segment, 1), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.touch(stream, &host, sizeof(host)), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.touch(stream, nullptr, 1), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.touch(stream, segment, 4_MiB + 1), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.touch(stream, range, 4_MiB + 1), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.touch(stream, ptr(addr(segment) + 4_MiB), 1), std::invalid_argument);
  REQUIRE_THROWS_WITH(backend.touch(stream, ptr(~std::uintptr_t{0}), 2),
                      "sim_backend: touch: [0xffffffffffffffff, +2) is not inside one live segment or reserved range");
  REQUIRE(backend.free_segment(segment, 4_MiB).ok());
  REQUIRE_THROWS_AS(backend.touch(stream, segment, 1), std::invalid_argument);
  CHECK(backend.live_touches() == 1);
}

TEST_CASE("sim_backend: unmap checks agree with a naive model under many live touches", "[sim_backend][vm][touch]") {
  // A plain list of every touch, checked in full, against the backend's
  // pruned index. Two slow streams never complete and pile up thousands of
  // touches in the first chunks; four fast ones touch anywhere and complete
  // often, so unmaps elsewhere both fail and succeed.
  struct naive_touch {
    std::uintptr_t begin;
    std::uintptr_t end;
    std::size_t stream;  // index into streams
    std::uint64_t sequence;
  };
  constexpr std::size_t k_chunks = 64;
  constexpr std::size_t k_slow_chunks = 8;
  constexpr std::size_t k_slow_streams = 2;
  constexpr std::size_t k_streams = 6;
  constexpr int k_steps = 30000;
  sim_backend backend(manual_events());
  void* range = map_chunks(backend, k_chunks);
  const std::uintptr_t base = addr(range);
  std::vector<stream_handle> streams;
  std::vector<event_handle> events;
  std::vector<std::uint64_t> recorded(k_streams, 0);   // sequence of each stream's event record
  std::vector<std::uint64_t> completed(k_streams, 0);  // per stream, newest completed sequence
  for (std::size_t i = 0; i < k_streams; ++i) {
    streams.push_back(backend.new_stream());
    events.push_back(must_create_event(backend));
  }
  std::vector<bool> mapped(k_chunks, true);
  std::vector<naive_touch> touches;
  std::uint64_t next_sequence = 1;
  std::mt19937_64 rng(20240611);
  std::size_t refusals = 0;
  std::size_t unmaps = 0;

  const auto live = [&](const naive_touch& t) { return completed[t.stream] < t.sequence; };
  const auto naive_blocked = [&](std::uintptr_t begin, std::uintptr_t end) {
    for (const naive_touch& t : touches) {
      if (live(t) && t.begin < end && begin < t.end) return true;
    }
    return false;
  };
  const auto naive_live_count = [&] {
    return static_cast<std::size_t>(std::count_if(touches.begin(), touches.end(), live));
  };

  for (int step = 0; step < k_steps; ++step) {
    CAPTURE(step);
    const std::size_t s = static_cast<std::size_t>(rng() % k_streams);
    const bool slow = s < k_slow_streams;
    const std::uint64_t roll = rng() % 1000;
    if (roll < 800) {
      // Mostly small touches, now and then one across several chunks.
      const std::size_t bytes = rng() % 10 == 0 ? 1 + rng() % 6_MiB : 1 + rng() % 4096;
      const std::size_t span = (slow ? k_slow_chunks : k_chunks) * 2_MiB;
      const std::uintptr_t at = base + rng() % (span - bytes);
      backend.touch(streams[s], ptr(at), bytes);
      touches.push_back({at, at + bytes, s, next_sequence});
    } else if (roll < 880) {
      REQUIRE(backend.record_event(events[s], streams[s]).ok());
      recorded[s] = next_sequence++;
    } else if (roll < 940) {
      if (slow) continue;
      backend.complete_event(events[s]);
      completed[s] = std::max(completed[s], recorded[s]);
    } else {
      const std::size_t c = static_cast<std::size_t>(rng() % k_chunks);
      void* at = chunk_at(range, c);
      if (mapped[c]) {
        const bool blocked = naive_blocked(addr(at), addr(at) + 2_MiB);
        const status unmapped = backend.vm_unmap(at, 2_MiB);
        CHECK(unmapped.ok() == !blocked);
        if (unmapped.ok()) {
          mapped[c] = false;
          ++unmaps;
        } else {
          CHECK(unmapped.code() == status_code::device_error);
          ++refusals;
        }
      } else {
        REQUIRE(backend.vm_map(at, 2_MiB, must_create_chunk(backend, 2_MiB)).ok());
        mapped[c] = true;
      }
    }
    if (step % 5000 == 4999) CHECK(backend.live_touches() == naive_live_count());
  }
  CHECK(naive_live_count() > 5000);
  CHECK(refusals > 100);
  CHECK(unmaps > 100);
  CHECK(backend.counters().unsafe_unmaps == refusals);
  REQUIRE(backend.synchronize_device().ok());
  CHECK(backend.live_touches() == 0);
  for (std::size_t c = 0; c < k_chunks; ++c) {
    if (mapped[c]) CHECK(unmap_chunk(backend, range, c).ok());
  }
}

TEST_CASE("sim_backend: hundreds of device-sized reservations fit in each device's addresses", "[sim_backend][vm]") {
  // Addresses are never reused, so every reserve/release cycle of a range
  // as large as an H200 consumes fresh address space: 64 TiB per device.
  constexpr std::size_t k_h200_bytes = 141_GiB;
  constexpr std::size_t k_device_span = std::size_t{1} << 46;
  constexpr std::uintptr_t k_double_exact = std::uintptr_t{1} << 53;
  // Each range is followed by a one-granule gap.
  constexpr std::size_t k_fitting_cycles = k_device_span / (k_h200_bytes + 2_MiB);
  static_assert(k_fitting_cycles >= 400, "room for long randomized runs");

  const auto cycle_until_exhausted = [&](sim_backend& backend, std::uintptr_t* first, std::uintptr_t* last_end) {
    std::size_t cycles = 0;
    std::uintptr_t previous_end = 0;
    for (;;) {
      void* range = nullptr;
      const status s = backend.vm_reserve(k_h200_bytes, &range);
      if (!s.ok()) {
        CHECK(s.code() == status_code::out_of_memory);
        CHECK(contains(s.message(), "address space exhausted"));
        break;
      }
      if (cycles == 0) *first = addr(range);
      CHECK(addr(range) > previous_end);  // fresh addresses, never reused
      previous_end = addr(range) + k_h200_bytes;
      REQUIRE(backend.vm_release(range, k_h200_bytes).ok());
      REQUIRE(++cycles <= k_fitting_cycles);
    }
    *last_end = previous_end;
    CHECK(backend.live_ranges() == 0);
    return cycles;
  };

  sim_backend device0;
  std::uintptr_t first0 = 0;
  std::uintptr_t end0 = 0;
  CHECK(cycle_until_exhausted(device0, &first0, &end0) == k_fitting_cycles);
  // Exhausted for ranges, not for small segments that still fit.
  void* segment = nullptr;
  CHECK(device0.allocate_segment(2_MiB, &segment).ok());

  sim_config config;
  config.device_index = 1;
  sim_backend device1(config);
  void* range1 = must_reserve(device1, 2_MiB);
  CHECK(addr(range1) >= end0);  // device 0 never spills into device 1's addresses
  CHECK(addr(range1) - first0 == k_device_span);

  config.device_index = 126;
  sim_backend last_device(config);
  std::uintptr_t first = 0;
  std::uintptr_t end = 0;
  CHECK(cycle_until_exhausted(last_device, &first, &end) == k_fitting_cycles);
  CHECK(end <= k_double_exact);

  config.device_index = 127;
  REQUIRE_THROWS_AS(sim_backend(config), std::invalid_argument);
  config.device_index = -1;
  REQUIRE_THROWS_AS(sim_backend(config), std::invalid_argument);
}

namespace {

// One call at a fault point: prepares what the call needs (through other
// points), makes the call, and reports whether the call took effect.
struct fault_probe {
  sim_fault_point point;
  const char* name;
  std::function<status(sim_backend&, bool* effect)> call;
  std::function<std::size_t(const sim_counters&)> counter;  // successes at this point, if counted
};

std::vector<fault_probe> fault_probes() {
  std::vector<fault_probe> probes;
  probes.push_back({sim_fault_point::allocate_segment, "allocate_segment",
                    [](sim_backend& b, bool* effect) {
                      const std::size_t before = b.live_segments();
                      void* p = nullptr;
                      const status s = b.allocate_segment(2_MiB, &p);
                      *effect = b.live_segments() == before + 1 && p != nullptr;
                      return s;
                    },
                    [](const sim_counters& c) { return c.segment_allocs; }});
  probes.push_back({sim_fault_point::free_segment, "free_segment",
                    [](sim_backend& b, bool* effect) {
                      void* p = must_allocate(b, 2_MiB);
                      const status s = b.free_segment(p, 2_MiB);
                      *effect = !b.is_device_memory(p, 1);
                      return s;
                    },
                    [](const sim_counters& c) { return c.segment_frees; }});
  probes.push_back({sim_fault_point::create_event, "create_event",
                    [](sim_backend& b, bool* effect) {
                      const std::size_t before = b.live_events();
                      event_handle e = 0;
                      const status s = b.create_event(&e);
                      *effect = b.live_events() == before + 1;
                      return s;
                    },
                    [](const sim_counters& c) { return c.events_created; }});
  probes.push_back({sim_fault_point::record_event, "record_event",
                    [](sim_backend& b, bool* effect) {
                      const event_handle e = must_create_event(b);
                      const status s = b.record_event(e, b.new_stream());
                      *effect = is_pending(b, e);
                      return s;
                    },
                    [](const sim_counters& c) { return c.event_records; }});
  probes.push_back({sim_fault_point::query_event, "query_event",
                    [](sim_backend& b, bool* effect) {
                      const event_handle e = must_create_event(b);
                      REQUIRE(b.record_event(e, b.new_stream()).ok());
                      bool done = true;  // the record is pending: a real answer is false
                      const status s = b.query_event(e, &done);
                      *effect = !done;
                      return s;
                    },
                    [](const sim_counters& c) { return c.event_queries; }});
  probes.push_back({sim_fault_point::synchronize_event, "synchronize_event",
                    [](sim_backend& b, bool* effect) {
                      const event_handle e = must_create_event(b);
                      REQUIRE(b.record_event(e, b.new_stream()).ok());
                      const status s = b.synchronize_event(e);
                      *effect = !is_pending(b, e);
                      return s;
                    },
                    [](const sim_counters& c) { return c.event_syncs; }});
  probes.push_back({sim_fault_point::stream_wait_event, "stream_wait_event",
                    [](sim_backend& b, bool* effect) {
                      const event_handle e = must_create_event(b);
                      REQUIRE(b.record_event(e, b.new_stream()).ok());
                      const stream_handle waiter = b.new_stream();
                      const status s = b.stream_wait_event(waiter, e);
                      *effect = b.stream_waited_on(waiter, e);
                      return s;
                    },
                    [](const sim_counters& c) { return c.stream_waits; }});
  probes.push_back({sim_fault_point::synchronize_device, "synchronize_device",
                    [](sim_backend& b, bool* effect) {
                      const event_handle e = must_create_event(b);
                      REQUIRE(b.record_event(e, b.new_stream()).ok());
                      const status s = b.synchronize_device();
                      *effect = b.pending_events().empty();
                      return s;
                    },
                    [](const sim_counters& c) { return c.device_syncs; }});
  probes.push_back({sim_fault_point::vm_reserve, "vm_reserve",
                    [](sim_backend& b, bool* effect) {
                      const std::size_t before = b.live_ranges();
                      void* r = nullptr;
                      const status s = b.vm_reserve(4_MiB, &r);
                      *effect = b.live_ranges() == before + 1;
                      return s;
                    },
                    nullptr});
  probes.push_back({sim_fault_point::vm_create, "vm_create",
                    [](sim_backend& b, bool* effect) {
                      const std::size_t before = b.used_bytes();
                      physical_handle c = 0;
                      const status s = b.vm_create(2_MiB, &c);
                      *effect = b.used_bytes() == before + 2_MiB;
                      return s;
                    },
                    nullptr});
  probes.push_back({sim_fault_point::vm_map, "vm_map",
                    [](sim_backend& b, bool* effect) {
                      void* r = must_reserve(b, 2_MiB);
                      const physical_handle c = must_create_chunk(b, 2_MiB);
                      const status s = b.vm_map(r, 2_MiB, c);
                      *effect = b.is_device_memory(r, 2_MiB);
                      return s;
                    },
                    [](const sim_counters& c) { return c.vm_maps; }});
  probes.push_back({sim_fault_point::vm_unmap, "vm_unmap",
                    [](sim_backend& b, bool* effect) {
                      void* r = must_reserve(b, 2_MiB);
                      const physical_handle c = must_create_chunk(b, 2_MiB);
                      REQUIRE(b.vm_map(r, 2_MiB, c).ok());
                      const status s = b.vm_unmap(r, 2_MiB);
                      *effect = !b.is_device_memory(r, 1);
                      return s;
                    },
                    [](const sim_counters& c) { return c.vm_unmaps; }});
  probes.push_back({sim_fault_point::vm_allow_peer, "vm_allow_peer",
                    [](sim_backend& b, bool* effect) {
                      void* r = must_reserve(b, 2_MiB);
                      const physical_handle c = must_create_chunk(b, 2_MiB);
                      REQUIRE(b.vm_map(r, 2_MiB, c).ok());
                      const status s = b.vm_allow_peer(r, 2_MiB, 1);
                      *effect = b.peer_allowed(r, 1);
                      return s;
                    },
                    nullptr});
  return probes;
}

}  // namespace

TEST_CASE("sim_backend: every fault point has a probe", "[sim_backend][faults]") {
  const auto probes = fault_probes();
  REQUIRE(probes.size() == static_cast<std::size_t>(k_sim_fault_point_count));
  for (int i = 0; i < k_sim_fault_point_count; ++i) {
    CHECK(static_cast<int>(probes[static_cast<std::size_t>(i)].point) == i);
  }
}

TEST_CASE("sim_backend: fail_nth fails exactly the nth call, without effect", "[sim_backend][faults]") {
  for (const fault_probe& probe : fault_probes()) {
    INFO("fault point " << probe.name);
    sim_backend backend(manual_events());
    backend.fail_nth(probe.point, 2, status_code::device_error);
    bool effect = false;

    status s = probe.call(backend, &effect);
    CHECK(s.ok());
    CHECK(effect);

    s = probe.call(backend, &effect);
    CHECK(s.code() == status_code::device_error);
    CHECK(contains(s.message(), probe.name));
    CHECK_FALSE(effect);

    s = probe.call(backend, &effect);
    CHECK(s.ok());
    CHECK(effect);

    if (probe.counter) CHECK(probe.counter(backend.counters()) == 2);
  }
}

TEST_CASE("sim_backend: fail_always fails every call until clear_faults", "[sim_backend][faults]") {
  for (const fault_probe& probe : fault_probes()) {
    INFO("fault point " << probe.name);
    sim_backend backend(manual_events());
    backend.fail_always(probe.point);  // out_of_memory by default
    bool effect = true;
    for (int i = 0; i < 3; ++i) {
      const status s = probe.call(backend, &effect);
      CHECK(s.code() == status_code::out_of_memory);
      CHECK_FALSE(effect);
    }
    if (probe.counter) CHECK(probe.counter(backend.counters()) == 0);
    backend.clear_faults();
    CHECK(probe.call(backend, &effect).ok());
    CHECK(effect);
  }
}

TEST_CASE("sim_backend: fault rules are per point and count every call", "[sim_backend][faults]") {
  sim_backend backend(manual_events());

  SECTION("a rule on one point leaves the others alone") {
    backend.fail_always(sim_fault_point::free_segment);
    void* p = must_allocate(backend, 2_MiB);
    CHECK(backend.free_segment(p, 2_MiB).code() == status_code::out_of_memory);
    CHECK(backend.is_device_memory(p, 2_MiB));
    backend.clear_faults();
    CHECK(backend.free_segment(p, 2_MiB).ok());
  }

  SECTION("an invalid call still counts towards nth") {
    backend.fail_nth(sim_fault_point::allocate_segment, 2, status_code::no_device);
    void* p = nullptr;
    CHECK(backend.allocate_segment(0, &p).code() == status_code::invalid_argument);
    CHECK(backend.allocate_segment(2_MiB, &p).code() == status_code::no_device);
    CHECK(backend.allocate_segment(2_MiB, &p).ok());
  }

  SECTION("a new one-shot rule replaces the old one; nth = 0 cancels it") {
    backend.fail_nth(sim_fault_point::create_event, 1);
    backend.fail_nth(sim_fault_point::create_event, 3);
    event_handle e = 0;
    CHECK(backend.create_event(&e).ok());
    CHECK(backend.create_event(&e).ok());
    CHECK(backend.create_event(&e).code() == status_code::out_of_memory);
    backend.fail_nth(sim_fault_point::create_event, 1);
    backend.fail_nth(sim_fault_point::create_event, 0);
    CHECK(backend.create_event(&e).ok());
  }

  SECTION("one-shot and always rules combine") {
    backend.fail_always(sim_fault_point::record_event, status_code::device_error);
    backend.fail_nth(sim_fault_point::record_event, 2, status_code::no_device);
    const event_handle e = must_create_event(backend);
    CHECK(backend.record_event(e, 0).code() == status_code::device_error);
    CHECK(backend.record_event(e, 0).code() == status_code::no_device);
    CHECK(backend.record_event(e, 0).code() == status_code::device_error);
    backend.clear_faults();
    CHECK(backend.record_event(e, 0).ok());
  }

  SECTION("ok is not a failure and installs no rule") {
    backend.fail_always(sim_fault_point::vm_reserve, status_code::ok);
    backend.fail_nth(sim_fault_point::vm_reserve, 1, status_code::ok);
    void* r = nullptr;
    CHECK(backend.vm_reserve(2_MiB, &r).ok());
  }

  SECTION("an out-of-range point is ignored") {
    backend.fail_always(static_cast<sim_fault_point>(k_sim_fault_point_count));
    backend.fail_nth(static_cast<sim_fault_point>(-1), 1);
    CHECK(backend.live_segments() == 0);
    must_allocate(backend, 2_MiB);
  }
}

TEST_CASE("sim_backend: concurrent use keeps the books straight", "[sim_backend][threads]") {
  sim_config config = manual_events();
  config.capacity_bytes = 1_GiB;
  sim_backend backend(config);
  constexpr int k_threads = 4;
  constexpr int k_rounds = 300;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&backend, &failures] {
      const stream_handle stream = backend.new_stream();
      for (int i = 0; i < k_rounds; ++i) {
        void* p = nullptr;
        event_handle e = 0;
        bool done = true;
        void* r = nullptr;
        physical_handle c = 0;
        const bool ok = backend.allocate_segment(2_MiB, &p).ok() && backend.create_event(&e).ok() &&
                        backend.record_event(e, stream).ok() && backend.query_event(e, &done).ok() && !done &&
                        backend.synchronize_event(e).ok() && backend.destroy_event(e).ok() &&
                        backend.vm_reserve(2_MiB, &r).ok() && backend.vm_create(2_MiB, &c).ok() &&
                        backend.vm_map(r, 2_MiB, c).ok() && backend.is_device_memory(p, 2_MiB) &&
                        backend.is_device_memory(r, 2_MiB) && backend.vm_unmap(r, 2_MiB).ok() &&
                        backend.vm_destroy(c).ok() && backend.vm_release(r, 2_MiB).ok() &&
                        backend.free_segment(p, 2_MiB).ok();
        if (!ok) failures.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(failures.load() == 0);
  CHECK(backend.used_bytes() == 0);
  CHECK(backend.live_segments() == 0);
  CHECK(backend.live_events() == 0);
  CHECK(backend.live_ranges() == 0);
  CHECK(backend.live_chunks() == 0);
  const auto counters = backend.counters();
  const std::size_t total = static_cast<std::size_t>(k_threads) * k_rounds;
  CHECK(counters.segment_allocs == total);
  CHECK(counters.segment_frees == total);
  CHECK(counters.event_records == total);
  CHECK(counters.vm_maps == total);
  CHECK(counters.vm_unmaps == total);
}

TEST_CASE("util: status names", "[errors]") {
  CHECK(std::string(to_string(status_code::ok)) == "ok");
  CHECK(std::string(to_string(status_code::out_of_memory)) == "out_of_memory");
  CHECK(std::string(to_string(status_code::invalid_argument)) == "invalid_argument");
  CHECK(std::string(to_string(status_code::not_supported)) == "not_supported");
  CHECK(std::string(to_string(status_code::device_error)) == "device_error");
  CHECK(std::string(to_string(status_code::no_device)) == "no_device");
  CHECK(std::string(to_string(static_cast<status_code>(99))) == "unknown_status");
}

TEST_CASE("util: format_bytes", "[errors]") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1024) == "1.00 KiB");
  CHECK(format_bytes(1536) == "1.50 KiB");
  CHECK(format_bytes(20_MiB) == "20.00 MiB");
  CHECK(format_bytes(3_GiB + 256_MiB) == "3.25 GiB");
  CHECK(format_bytes(1_MiB - 1) == "1.00 MiB");  // not "1024.00 KiB"
  CHECK(format_bytes(std::size_t{5} << 40) == "5.00 TiB");
  CHECK(format_bytes(SIZE_MAX) == "16.00 EiB");
}

TEST_CASE("util: out_of_memory message names every figure", "[errors]") {
  oom_context context;
  context.requested_bytes = 2_GiB;
  context.device = 3;
  context.device_total_bytes = 140_GiB;
  context.device_free_bytes = 1_GiB + 200_MiB;
  context.allocated_bytes = 120_GiB;
  context.reserved_bytes = 123_GiB;
  context.largest_free_block_bytes = 512_MiB;
  context.allowed_bytes = 140_GiB;
  const out_of_memory error(context);
  const std::string message = error.what();
  INFO(message);
  // torch's sentences (no "allowed" without a fraction cap), then
  // streamalloc's; 3 GiB unallocated >= 2 GiB requested with no block that
  // large: the fragmentation hint.
  CHECK(message ==
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 140.00 GiB of which 1.20 GiB "
        "is free. Of the allocated memory 120.00 GiB is allocated by PyTorch, and 3.00 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
        "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf) streamalloc: 123.00 GiB reserved, 3.00 GiB of it "
        "unallocated; the largest free cached block is 512.00 MiB. The reserved but unallocated memory is "
        "fragmented: set STREAMALLOC_CONF=max_split_size_mb:<MB> so large cached blocks are not split, or call "
        "empty_cache() to return cached segments to the device.");
  CHECK(error.context().device == 3);
  CHECK(error.context().requested_bytes == 2_GiB);

  const std::bad_alloc& base = error;
  CHECK(std::string(base.what()) == message);

  // Where the pool grows expandable segments, max_split_size_mb does not
  // bind (Note [max_split in expandable segments]): the hint leaves it out.
  context.expandable_segments = true;
  const std::string expandable_message = out_of_memory(context).what();
  const std::string hint =
      " The reserved but unallocated memory is fragmented: call empty_cache() to return cached segments to the device.";
  REQUIRE(expandable_message.size() > hint.size());
  CHECK(expandable_message.substr(expandable_message.size() - hint.size()) == hint);
  CHECK(expandable_message.find("max_split_size_mb") == std::string::npos);
}

TEST_CASE("util: out_of_memory mentions the fraction cap and skips the hint when not fragmented", "[errors]") {
  oom_context context;
  context.requested_bytes = 8_GiB;
  context.device_total_bytes = 80_GiB;
  context.device_free_bytes = 40_GiB;
  context.allocated_bytes = 39_GiB;
  context.reserved_bytes = 40_GiB;
  context.largest_free_block_bytes = 1_GiB;
  context.allowed_bytes = 40_GiB;
  const std::string message = out_of_memory(context).what();
  INFO(message);
  CHECK(message ==
        "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which 40.00 GiB "
        "is free. 40.00 GiB allowed; Of the allocated memory 39.00 GiB is allocated by PyTorch, and 1024.00 MiB is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
        "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf) streamalloc: 40.00 GiB reserved, 1024.00 MiB of it "
        "unallocated; the largest free cached block is 1024.00 MiB.");
}
