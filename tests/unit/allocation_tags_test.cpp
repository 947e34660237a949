// allocation_tags: interned names, the thread's and the inherited current
// tag, record/erase and the sums reports are built from (equal to the
// simulated allocator's allocated bytes when every allocation is
// recorded), deterministic sampling and its scaling, and threads.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/core/allocation_tags.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::all;
using streamalloc::test::sim_fixture;

namespace {

std::uintptr_t fake_address(std::size_t i) { return 0x7f0000000000ULL + i * 4096; }

std::size_t bytes_of(const tag_summary& s, const std::string& name) {
  for (const tag_total& t : s.by_tag) {
    if (t.name == name) return t.bytes;
  }
  return 0;
}

std::size_t count_of(const tag_summary& s, const std::string& name) {
  for (const tag_total& t : s.by_tag) {
    if (t.name == name) return t.count;
  }
  return 0;
}

// Restores the calling thread's tag when a test ends, whatever it set.
struct thread_tag_guard {
  tag_id saved = allocation_tags::thread_tag();
  ~thread_tag_guard() { allocation_tags::set_thread_tag(saved); }
};

}  // namespace

TEST_CASE("allocation_tags: names are interned once and read back", "[allocation_tags]") {
  allocation_tags tags;
  CHECK(tags.intern("untagged") == k_untagged);
  CHECK(tags.name_of(k_untagged) == "untagged");
  const tag_id optimizer = tags.intern("optimizer");
  const tag_id mlp = tags.intern("blocks.3.mlp");
  CHECK(optimizer != k_untagged);
  CHECK(mlp != optimizer);
  CHECK(tags.intern(std::string("optim") + "izer") == optimizer);
  CHECK(tags.name_of(mlp) == "blocks.3.mlp");
  CHECK(tags.tag_count() == 3);
  CHECK_THROWS_AS(tags.intern(""), usage_error);
  CHECK_THROWS_AS(tags.name_of(99), usage_error);
}

TEST_CASE("allocation_tags: records follow the thread's tag and sum by tag, size and device", "[allocation_tags]") {
  thread_tag_guard guard;
  allocation_tags tags;
  const tag_id a = tags.intern("a");
  const tag_id b = tags.intern("b");

  tags.record(fake_address(0), 4096, 0, 1);  // still off: ignored
  CHECK(tags.summary(0).by_tag.empty());

  tags.enable({});
  REQUIRE(tags.enabled());
  tags.record(fake_address(1), 512, 0, 1);  // no tag set: untagged
  {
    allocation_tags::scope in_a(a);
    CHECK(tags.current() == a);
    tags.record(fake_address(2), 2_MiB, 0, 1);
    {
      allocation_tags::scope in_b(b);
      tags.record(fake_address(3), 20_MiB, 0, 1);
      tags.record(fake_address(4), 20_MiB, 1, 1);  // another device
    }
    CHECK(tags.current() == a);
    tags.record(fake_address(5), 100_KiB, 0, 1);
  }
  CHECK(tags.current() == k_untagged);
  tags.record(fake_address(6), 1_KiB, 0, 1, b);  // an explicit tag

  tag_id found = k_untagged;
  REQUIRE(tags.tag_of(fake_address(3), &found));
  CHECK(found == b);
  CHECK_FALSE(tags.tag_of(fake_address(0), &found));

  const tag_summary device0 = tags.summary(0);
  CHECK_FALSE(device0.sampled);
  CHECK(bytes_of(device0, "untagged") == 512);
  CHECK(bytes_of(device0, "a") == 2_MiB + 100_KiB);
  CHECK(bytes_of(device0, "b") == 20_MiB + 1_KiB);
  CHECK(count_of(device0, "b") == 2);
  CHECK(device0.recorded_bytes == 512 + 2_MiB + 100_KiB + 20_MiB + 1_KiB);
  CHECK(device0.recorded_count == 5);
  REQUIRE(device0.by_tag.size() == 3);
  CHECK(device0.by_tag[0].name == "b");  // most bytes first
  CHECK(device0.by_tag[2].name == "untagged");

  // Buckets: < 64 KiB, < 1 MiB, < 16 MiB, < 256 MiB, < 4 GiB, the rest.
  REQUIRE(device0.by_size.size() == 6);
  CHECK(device0.by_size[0].bytes == 512 + 1_KiB);
  CHECK(device0.by_size[0].count == 2);
  CHECK(device0.by_size[1].bytes == 100_KiB);
  CHECK(device0.by_size[2].bytes == 2_MiB);
  CHECK(device0.by_size[3].bytes == 20_MiB);
  CHECK(device0.by_size[3].min_bytes == 16_MiB);
  CHECK(device0.by_size[3].max_bytes == 256_MiB);
  std::size_t bucket_sum = 0;
  for (const size_bucket_total& bucket : device0.by_size) bucket_sum += bucket.bytes;
  CHECK(bucket_sum == device0.recorded_bytes);

  CHECK(tags.summary(1).recorded_bytes == 20_MiB);
  CHECK(tags.summary(allocation_tags::k_all_devices_tags).recorded_bytes == device0.recorded_bytes + 20_MiB);

  tags.erase(fake_address(3));
  tags.erase(fake_address(3));   // twice: ignored
  tags.erase(fake_address(77));  // never recorded: ignored
  CHECK(bytes_of(tags.summary(0), "b") == 1_KiB);

  // A record at an address already recorded replaces it.
  tags.record(fake_address(6), 2_KiB, 0, 1, a);
  CHECK(bytes_of(tags.summary(0), "b") == 0);
  CHECK(bytes_of(tags.summary(0), "a") == 2_MiB + 100_KiB + 2_KiB);
}

TEST_CASE("allocation_tags: disable forgets, enable starts empty, enable while on keeps records", "[allocation_tags]") {
  allocation_tags tags;
  tags.enable({});
  tags.record(fake_address(1), 4096, 0, 1);
  tagging_options sampled;
  sampled.sample_every = 8;
  tags.enable(sampled);  // only changes the sampling
  CHECK(tags.summary(0).recorded_bytes == 4096);
  CHECK(tags.options().sample_every == 8);
  CHECK(tags.summary(0).sampled);
  tags.disable();
  CHECK_FALSE(tags.enabled());
  CHECK(tags.summary(0).recorded_bytes == 0);
  tags.record(fake_address(2), 4096, 0, 1);
  tags.enable({});
  CHECK(tags.summary(0).recorded_bytes == 0);
  tagging_options zero;
  zero.sample_every = 0;
  CHECK_THROWS_AS(tags.enable(zero), usage_error);
}

TEST_CASE("allocation_tags: threads without a tag of their own inherit one", "[allocation_tags]") {
  thread_tag_guard guard;
  allocation_tags tags;
  const tag_id loss = tags.intern("loss");
  const tag_id layer = tags.intern("layer");
  const tag_id previous = tags.set_inherited_tag(loss);
  CHECK(previous == k_untagged);
  tag_id seen_plain = k_untagged;
  tag_id seen_own = k_untagged;
  std::thread([&] {
    seen_plain = tags.current();
    allocation_tags::scope own(layer);
    seen_own = tags.current();
  }).join();
  CHECK(seen_plain == loss);
  CHECK(seen_own == layer);  // a thread's own tag wins

  // A scope restores the inherited tag only if nobody replaced it since.
  tags.set_inherited_tag(layer);
  tags.restore_inherited_tag(loss, k_untagged);
  CHECK(tags.inherited_tag() == layer);
  tags.restore_inherited_tag(layer, k_untagged);
  CHECK(tags.inherited_tag() == k_untagged);
}

TEST_CASE("allocation_tags: sampling records one in N small allocations and scales by N", "[allocation_tags]") {
  thread_tag_guard guard;
  allocation_tags tags;
  tagging_options options;
  options.sample_every = 16;
  options.always_record_bytes = 1_MiB;
  tags.enable(options);

  constexpr std::size_t k_small = 1600;
  std::vector<std::size_t> picked;
  for (std::size_t i = 0; i < k_small; ++i) {
    const std::uint32_t weight = tags.sample(4_KiB);
    if (weight != 0) {
      CHECK(weight == 16);
      picked.push_back(i);
      tags.record(fake_address(i), 4_KiB, 0, weight);
    }
  }
  // Exactly one per window of 16, at offsets that are not all the same.
  REQUIRE(picked.size() == k_small / 16);
  std::set<std::size_t> offsets;
  for (std::size_t k = 0; k < picked.size(); ++k) {
    CHECK(picked[k] / 16 == k);
    offsets.insert(picked[k] % 16);
  }
  CHECK(offsets.size() > 4);

  // Large allocations are always recorded, exactly.
  for (std::size_t i = 0; i < 3; ++i) {
    const std::uint32_t weight = tags.sample(64_MiB);
    CHECK(weight == 1);
    tags.record(fake_address(10000 + i), 64_MiB, 0, weight);
  }
  const tag_summary s = tags.summary(0);
  CHECK(s.sampled);
  CHECK(s.sample_every == 16);
  CHECK(s.recorded_bytes == k_small * 4_KiB + 3 * 64_MiB);  // the estimate is exact here
  CHECK(s.recorded_count == k_small + 3);
}

TEST_CASE("allocation_tags: sampling does not alias with a loop of period N", "[allocation_tags]") {
  thread_tag_guard guard;
  allocation_tags tags;
  tagging_options options;
  options.sample_every = 4;
  tags.enable(options);
  const tag_id ids[4] = {tags.intern("t0"), tags.intern("t1"), tags.intern("t2"), tags.intern("t3")};
  // Four tags in a fixed order, as a training loop allocates: a counter
  // modulo 4 would always pick the same one.
  std::size_t n = 0;
  for (int step = 0; step < 1000; ++step) {
    for (tag_id id : ids) {
      allocation_tags::scope scope(id);
      tags.record(fake_address(n), 1_KiB, 0, tags.sample(1_KiB));
      ++n;
    }
  }
  const tag_summary s = tags.summary(0);
  for (const char* name : {"t0", "t1", "t2", "t3"}) {
    INFO(name);
    // True value 1000 KiB each; the sampled estimate stays near it.
    CHECK(bytes_of(s, name) > 700 * 1_KiB);
    CHECK(bytes_of(s, name) < 1300 * 1_KiB);
  }
}

TEST_CASE("allocation_tags: with every allocation recorded, sums equal the allocator's allocated bytes",
          "[allocation_tags]") {
  thread_tag_guard guard;
  sim_fixture f;
  allocation_tags tags;
  tags.enable({});
  const tag_id names[3] = {tags.intern("model"), tags.intern("optimizer"), k_untagged};
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::size_t> size_of(1, 40_MiB);
  std::vector<void*> live;
  for (int i = 0; i < 400; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      const std::size_t k = rng() % live.size();
      // As the torch layer does: forget first, then free.
      tags.erase(reinterpret_cast<std::uintptr_t>(live[k]));
      f.alloc.free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      allocation_tags::scope scope(names[rng() % 3]);
      void* p = f.alloc.allocate(size_of(rng), f.s1);
      tags.record(reinterpret_cast<std::uintptr_t>(p), f.alloc.allocation_size(p), f.sim.device_index(), 1);
      live.push_back(p);
    }
    const tag_summary s = tags.summary(f.sim.device_index());
    REQUIRE(static_cast<std::int64_t>(s.recorded_bytes) == all(f.stats().allocated_bytes));
    REQUIRE(static_cast<std::int64_t>(s.recorded_count) == all(f.stats().allocation));
  }
  for (void* p : live) {
    tags.erase(reinterpret_cast<std::uintptr_t>(p));
    f.alloc.free(p);
  }
  CHECK(tags.summary(f.sim.device_index()).recorded_bytes == 0);
}

TEST_CASE("allocation_tags: threads record, erase and read at once", "[allocation_tags][threads]") {
  allocation_tags tags;
  tagging_options options;
  options.sample_every = 1;
  tags.enable(options);
  constexpr int k_threads = 8;
  constexpr std::size_t k_ops = 20000;
  std::vector<tag_id> ids;
  for (int t = 0; t < k_threads; ++t) ids.push_back(tags.intern("thread" + std::to_string(t)));
  std::vector<std::size_t> expected(k_threads, 0);
  std::atomic<bool> stop{false};
  // A reader summing while the writers run must never see a torn total.
  std::thread reader([&] {
    while (!stop.load()) (void)tags.summary(allocation_tags::k_all_devices_tags);
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < k_threads; ++t) {
    writers.emplace_back([&, t] {
      allocation_tags::scope scope(ids[static_cast<std::size_t>(t)]);
      std::mt19937 rng(static_cast<unsigned>(t));
      std::map<std::uintptr_t, std::size_t> live;
      for (std::size_t i = 0; i < k_ops; ++i) {
        // Disjoint address ranges per thread, as an allocator hands out.
        const std::uintptr_t address = fake_address(static_cast<std::size_t>(t) * 1000000 + rng() % 512);
        auto it = live.find(address);
        if (it != live.end()) {
          tags.erase(address);
          live.erase(it);
        } else {
          const std::size_t bytes = 512 * (1 + rng() % 64);
          tags.record(address, bytes, t % 2, 1);
          live.emplace(address, bytes);
        }
      }
      for (const auto& [address, bytes] : live) expected[static_cast<std::size_t>(t)] += bytes;
    });
  }
  for (std::thread& w : writers) w.join();
  stop = true;
  reader.join();
  const tag_summary s = tags.summary(allocation_tags::k_all_devices_tags);
  for (int t = 0; t < k_threads; ++t) {
    INFO("thread " << t);
    CHECK(bytes_of(s, "thread" + std::to_string(t)) == expected[static_cast<std::size_t>(t)]);
  }
  std::size_t even = 0;
  for (int t = 0; t < k_threads; t += 2) even += expected[static_cast<std::size_t>(t)];
  CHECK(tags.summary(0).recorded_bytes == even);
}
