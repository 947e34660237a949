// Settings changed while memory is live (torch.cuda.memory.
// _set_allocator_settings): each run-time key on one allocator, expandable
// segments switched off and on with live blocks of both kinds, private
// pools' ranges switched on and off with a live pool, refused
// fields and chunk sizes leaving everything as it was, device_allocators
// applying a change to every device (or to none), and changes racing with
// allocations.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using namespace streamalloc::test;

namespace {

void apply(caching_allocator& alloc, const std::string& settings) {
  alloc.update_config(alloc.config().with(settings));
}

bool expandable_at(const sim_fixture& f, const void* p) {
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  return seg->is_expandable;
}

allocator_config plain_config() {
  allocator_config c;
  c.expandable_segments = false;
  return c;
}

}  // namespace

TEST_CASE("update_config: max_split_size_mb with live blocks", "[update_config]") {
  sim_fixture f(plain_device());
  void* big = f.alloc.allocate(100_MiB, f.s1);
  void* small = f.alloc.allocate(30_MiB, f.s1);
  CHECK(f.stats().oversize_allocations.current == 0);

  apply(f.alloc, "max_split_size_mb:64");
  CHECK(f.alloc.config().max_split_bytes == 64_MiB);
  CHECK(f.stats().max_split_size == static_cast<std::int64_t>(64_MiB));
  // Live blocks are judged by the new limit from now on.
  CHECK(f.stats().oversize_allocations.current == 1);
  CHECK(f.stats().oversize_segments.current == 1);
  f.check_consistent();

  // The cached 100 MiB block is oversize now: a 30 MiB request does not split it.
  f.alloc.free(big);
  CHECK(f.stats().oversize_allocations.current == 0);
  void* other = f.alloc.allocate(30_MiB, f.s1);
  CHECK(other != big);
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(160_MiB));
  f.check_consistent();

  apply(f.alloc, "max_split_size_mb:unlimited");
  CHECK(f.stats().max_split_size == -1);
  CHECK(f.stats().oversize_segments.current == 0);
  f.check_consistent();
  f.alloc.free(small);
  f.alloc.free(other);
  f.check_consistent();
}

TEST_CASE("update_config: roundup_power2_divisions, both forms", "[update_config]") {
  sim_fixture f(plain_device());
  const std::size_t request = 1_MiB + 512_KiB + 1;
  auto rounded = [&] {
    void* p = f.alloc.allocate(request, f.s1);
    const std::size_t size = f.alloc.allocation_size(p);
    f.alloc.free(p);
    return size;
  };
  CHECK(rounded() == 1_MiB + 512_KiB + 512);
  apply(f.alloc, "roundup_power2_divisions:4");
  CHECK(rounded() == 1_MiB + 768_KiB);
  apply(f.alloc, "roundup_power2_divisions:[1:2,>:8]");
  CHECK(rounded() == 2_MiB);
  apply(f.alloc, "roundup_power2_divisions:0");
  CHECK(rounded() == 1_MiB + 512_KiB + 512);
  f.check_consistent();
}

TEST_CASE("update_config: garbage_collection_threshold and max_non_split_rounding_mb", "[update_config]") {
  sim_fixture f(plain_device(100_MiB));
  void* a = f.alloc.allocate(30_MiB, f.s1);
  void* b = f.alloc.allocate(30_MiB, f.s1);
  f.alloc.free(a);
  apply(f.alloc, "garbage_collection_threshold:0.5,max_non_split_rounding_mb:40");
  CHECK(f.alloc.config().garbage_collection_threshold == 0.5);
  CHECK(f.alloc.config().max_non_split_rounding_bytes == 40_MiB);
  // 60 MiB reserved > half the device: the cached 30 MiB segment goes back
  // before the allocator grows.
  void* c = f.alloc.allocate(40_MiB, f.s1);
  CHECK(f.sim.counters().segment_frees == 1);
  CHECK(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(70_MiB));
  f.alloc.free(b);
  f.alloc.free(c);
  f.check_consistent();
}

TEST_CASE("update_config: expandable segments switched off with live expandable blocks", "[update_config]") {
  sim_fixture f(vmm_device());
  void* a = f.alloc.allocate(3_MiB, f.s1);
  void* b = f.alloc.allocate(3_MiB, f.s1);
  REQUIRE(expandable_at(f, a));
  f.alloc.free(b);  // a free mapped block of the range, big enough for 3 MiB

  apply(f.alloc, "expandable_segments:False");
  CHECK_FALSE(f.alloc.config().expandable_segments);
  f.check_consistent();
  // New requests get plain memory, not the free expandable block (torch's rule).
  void* c = f.alloc.allocate(3_MiB, f.s1);
  CHECK(c != b);
  CHECK_FALSE(expandable_at(f, c));
  void* tiny = f.alloc.allocate(4_KiB, f.s1);
  CHECK_FALSE(expandable_at(f, tiny));
  CHECK(f.sim.live_segments() == 2);
  f.check_consistent();

  // Live expandable blocks are freed as before and their chunks go back.
  f.alloc.free(a);
  f.alloc.empty_cache();
  CHECK(f.sim.mapped_chunks() == 0);
  f.check_consistent();

  // Switched on again: new growth maps chunks again.
  apply(f.alloc, "expandable_segments:True");
  void* d = f.alloc.allocate(30_MiB, f.s1);
  CHECK(expandable_at(f, d));
  f.check_consistent();
  for (void* p : {c, tiny, d}) f.alloc.free(p);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

TEST_CASE("update_config: expandable segments switched on with live plain blocks, and off again", "[update_config]") {
  sim_fixture f(vmm_device(), plain_config());
  void* plain = f.alloc.allocate(3_MiB, f.s1);
  REQUIRE_FALSE(expandable_at(f, plain));

  apply(f.alloc, "expandable_segments:True");
  CHECK(f.alloc.config().expandable_segments);
  // Larger than the plain segment's free remainder: the range grows.
  void* grown = f.alloc.allocate(30_MiB, f.s1);
  CHECK(expandable_at(f, grown));
  // Plain free blocks still serve requests that fit them.
  void* fits = f.alloc.allocate(8_MiB, f.s1);
  CHECK_FALSE(expandable_at(f, fits));
  f.check_consistent();

  apply(f.alloc, "expandable_segments:False");
  f.check_consistent();
  for (void* p : {plain, grown, fits}) f.alloc.free(p);
  f.check_consistent();
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  CHECK(f.sim.live_chunks() == 0);
  f.check_consistent();
}

TEST_CASE("update_config: private ranges switched on and off with a live pool", "[update_config][private_pool]") {
  sim_fixture f(vmm_device());
  const auto captured = [&](std::size_t bytes) {
    f.alloc.begin_allocate_to_pool(4, [&](stream_handle s) { return s == f.s1; });
    void* p = f.alloc.allocate(bytes, f.s1);
    f.alloc.end_allocate_to_pool(4);
    return p;
  };
  void* plain = captured(3_MiB);
  CHECK_FALSE(expandable_at(f, plain));

  // torch's key, as _set_allocator_settings passes it on.
  f.alloc.update_config(f.alloc.config().with(allocator_config::split_torch_settings("expandable_segments:True").applied));
  CHECK(f.alloc.config().expandable_private_pools);
  void* ranged = captured(30_MiB);  // more than the plain segment's remainder
  CHECK(expandable_at(f, ranged));
  f.check_consistent();

  // Off again: growth is plain; the range's blocks live on.
  apply(f.alloc, "expandable_private_pools:False");
  void* again = captured(30_MiB);
  CHECK_FALSE(expandable_at(f, again));
  CHECK(expandable_at(f, ranged));
  f.check_consistent();

  for (void* p : {plain, ranged, again}) f.alloc.free(p);
  for (int use = 0; use < 3; ++use) f.alloc.release_pool(4);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  CHECK(f.sim.live_ranges() == 0);
  f.check_consistent();
}

TEST_CASE("update_config: a device without virtual memory keeps plain segments", "[update_config]") {
  sim_fixture f(plain_device(), plain_config());
  apply(f.alloc, "expandable_segments:True");
  CHECK(f.alloc.config().expandable_segments);  // the setting is kept, as at construction
  void* p = f.alloc.allocate(30_MiB, f.s1);
  CHECK_FALSE(expandable_at(f, p));
  f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("update_config: refused changes leave the allocator as it was", "[update_config]") {
  SECTION("a field that cannot change at run time") {
    sim_fixture f(plain_device());
    const std::string before = f.alloc.config().to_string();
    try {
      apply(f.alloc, "small_segment_mb:4");
      FAIL("small_segment_mb changed at run time");
    } catch (const usage_error& e) {
      CHECK(contains(e.what(), "small_segment_bytes (STREAMALLOC_CONF key small_segment_mb)"));
    }
    allocator_config both = f.alloc.config().with("max_split_size_mb:64");
    both.cross_stream_reuse = false;
    CHECK_THROWS_AS(f.alloc.update_config(both), usage_error);
    CHECK(f.alloc.config().to_string() == before);
  }
  SECTION("an invalid config") {
    sim_fixture f(plain_device());
    allocator_config bad = f.alloc.config();
    bad.max_split_bytes = 10_MiB;  // below large_segment_mb
    CHECK_THROWS_AS(f.alloc.update_config(bad), config_error);
    CHECK(f.alloc.config().max_split_bytes == SIZE_MAX);
  }
  SECTION("a chunk size the device refuses when expandable segments are switched on") {
    allocator_config odd = plain_config();
    odd.vmm_chunk_bytes = 3_MiB;  // not a multiple of the 2 MiB granularity
    sim_fixture f(vmm_device(), odd);
    try {
      apply(f.alloc, "expandable_segments:True,max_split_size_mb:64");
      FAIL("a 3 MiB chunk was accepted");
    } catch (const config_error& e) {
      CHECK(contains(e.what(), "vmm_chunk_mb"));
    }
    CHECK_FALSE(f.alloc.config().expandable_segments);
    CHECK(f.alloc.config().max_split_bytes == SIZE_MAX);
    void* p = f.alloc.allocate(3_MiB, f.s1);
    CHECK_FALSE(expandable_at(f, p));
    f.alloc.free(p);
    f.check_consistent();
  }
}

namespace {

// Sim devices whose virtual-memory granularity the test chooses.
struct granular_devices {
  std::vector<std::size_t> granularity;
  device_allocators::backend_factory factory() {
    return [this](int device, status*) -> std::unique_ptr<device_backend> {
      sim_config config;
      config.device_index = device;
      config.capacity_bytes = 1_GiB;
      config.vm_granularity_bytes = granularity[static_cast<std::size_t>(device)];
      return std::make_unique<sim_backend>(config);
    };
  }
};

}  // namespace

TEST_CASE("update_config: device_allocators applies a change to every device, now and later", "[update_config]") {
  granular_devices devices{{2_MiB, 2_MiB, 2_MiB}};
  device_allocators all(3, devices.factory(), allocator_config{});
  void* p = all.at(0).allocate(1_MiB, 0);
  // torch.cuda.memory._set_allocator_settings("max_split_size_mb:64,roundup_power2_divisions:4")
  all.update_config(all.config().with("max_split_size_mb:64,roundup_power2_divisions:4"));
  CHECK(all.config().max_split_bytes == 64_MiB);
  CHECK(all.at(0).config().max_split_bytes == 64_MiB);
  CHECK(all.at(0).config().roundup_power2_divisions == 4);
  CHECK(all.at(2).config().max_split_bytes == 64_MiB);  // created after the change
  CHECK(all.find(1) == nullptr);

  CHECK_THROWS_AS(all.update_config(all.config().with("min_large_alloc_mb:12")), usage_error);
  CHECK(all.at(0).config().min_large_alloc_bytes == 10_MiB);
  CHECK(all.at(1).config().min_large_alloc_bytes == 10_MiB);
  all.at(0).free(p);
}

TEST_CASE("update_config: a device that refuses undoes the change on the others", "[update_config]") {
  granular_devices devices{{2_MiB, 4_MiB}};  // device 1 cannot map 2 MiB chunks
  device_allocators all(2, devices.factory(), plain_config());
  (void)all.at(0);
  (void)all.at(1);
  CHECK_THROWS_AS(all.update_config(all.config().with("expandable_segments:True,max_split_size_mb:64")),
                  config_error);
  for (int d = 0; d < 2; ++d) {
    INFO("device " << d);
    CHECK_FALSE(all.at(d).config().expandable_segments);
    CHECK(all.at(d).config().max_split_bytes == SIZE_MAX);
  }
  CHECK_FALSE(all.config().expandable_segments);
  void* p = all.at(0).allocate(3_MiB, 0);
  all.at(0).free(p);
  all.at(0).validate();
}

TEST_CASE("update_config: changes race with allocations", "[update_config][threads]") {
  sim_fixture f(vmm_device());
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      const stream_handle stream = t == 0 ? f.s1 : f.s2;
      std::vector<void*> live;
      std::size_t i = 0;
      while (!stop.load()) {
        live.push_back(f.alloc.allocate(((i++ % 5) + 1) * 7_MiB, stream));
        if (live.size() > 4) {
          f.alloc.free(live.front());
          live.erase(live.begin());
        }
      }
      for (void* p : live) f.alloc.free(p);
    });
  }
  const char* settings[] = {"max_split_size_mb:32,expandable_segments:False", "roundup_power2_divisions:[8:2,>:4]",
                            "max_split_size_mb:unlimited,expandable_segments:True",
                            "garbage_collection_threshold:0.5,roundup_power2_divisions:0"};
  for (int i = 0; i < 200; ++i) {
    apply(f.alloc, settings[i % 4]);
    if (i % 10 == 0) f.alloc.validate();
  }
  stop.store(true);
  for (std::thread& w : workers) w.join();
  f.check_consistent();
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
}
