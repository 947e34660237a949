// Concurrency test of caching_allocator: eight threads allocate, free and
// record_stream on one shared allocator (events complete immediately). A
// registry of live ranges proves no two threads ever hold overlapping
// memory; the end state must validate and match the recount. Short enough
// to run under ThreadSanitizer.
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::immediate_events;
using streamalloc::test::sim_fixture;

namespace {

// Live ranges of all threads: address -> size. Every allocation is entered
// after allocate returns and removed before free is called, so an overlap
// seen here is two threads owning the same bytes at once.
class range_registry {
 public:
  void add(std::uintptr_t address, std::size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = ranges_.lower_bound(address);
    if (next != ranges_.end() && next->first < address + size) record_locked("overlaps the next live range");
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > address) record_locked("overlaps the previous live range");
    }
    ranges_[address] = size;
  }
  void remove(std::uintptr_t address) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ranges_.erase(address) != 1) record_locked("removed a range that was not registered");
  }
  void record(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    record_locked(what);
  }
  std::string first_failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_failure_;
  }
  std::map<std::uintptr_t, std::size_t> ranges() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ranges_;
  }

 private:
  void record_locked(const std::string& what) {
    if (first_failure_.empty()) first_failure_ = what;
  }

  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> ranges_;
  std::string first_failure_;
};

struct owned_range {
  void* ptr;
  std::size_t size;
};

}  // namespace

TEST_CASE("concurrency: threads share one allocator without overlapping ranges", "[threads]") {
  constexpr int k_threads = 8;
  constexpr int k_ops_per_thread = 20000;
  constexpr std::size_t k_max_live_per_thread = 32;
  sim_fixture f(immediate_events());
  std::vector<stream_handle> streams;
  for (int t = 0; t < k_threads; ++t) streams.push_back(f.sim.new_stream());
  range_registry registry;
  std::vector<std::vector<owned_range>> kept(k_threads);

  const auto worker = [&](int t) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919 + 17);
    std::vector<owned_range>& mine = kept[static_cast<std::size_t>(t)];
    try {
      for (int op = 0; op < k_ops_per_thread; ++op) {
        const std::uint64_t pick = rng() % 100;
        if (pick < 50 && mine.size() < k_max_live_per_thread) {
          // Mostly the thread's own stream, sometimes a neighbour's.
          const stream_handle s = streams[static_cast<std::size_t>(rng() % 4 == 0 ? (t + 1) % k_threads : t)];
          const double exponent =
              std::uniform_real_distribution<double>(0.0, std::log(static_cast<double>(8_MiB)))(rng);
          const auto size = static_cast<std::size_t>(std::exp(exponent));
          void* p = f.alloc.allocate(size, s);
          if (p == nullptr) {
            registry.record("allocate returned nullptr");
            return;
          }
          const std::size_t block = f.alloc.allocation_size(p);
          if (block < size) registry.record("block smaller than the request");
          registry.add(addr(p), block);
          mine.push_back({p, block});
        } else if (pick < 88 && !mine.empty()) {
          const std::size_t k = rng() % mine.size();
          const owned_range r = mine[k];
          mine[k] = mine.back();
          mine.pop_back();
          registry.remove(addr(r.ptr));
          f.alloc.free(r.ptr);
        } else if (pick < 98 && !mine.empty()) {
          f.alloc.record_stream(mine[rng() % mine.size()].ptr, streams[rng() % streams.size()]);
        } else if (pick < 99) {
          const device_stats st = f.alloc.stats();
          if (st.allocation[0].current < 0 || st.reserved_bytes[0].current < st.allocated_bytes[0].current) {
            registry.record("inconsistent stats read concurrently");
          }
        } else {
          f.alloc.validate();  // takes the lock and walks every block while others mutate
        }
        if (op % 1000 == 999) f.alloc.empty_cache();
      }
    } catch (const std::exception& e) {
      registry.record(std::string("thread threw: ") + e.what());
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();

  const std::string failure = registry.first_failure();
  INFO(failure);
  REQUIRE(failure.empty());

  // Global check: what the threads still own is disjoint, and is exactly
  // what the allocator counts as allocated.
  std::size_t live = 0;
  std::size_t live_bytes = 0;
  std::map<std::uintptr_t, std::size_t> all_ranges;
  for (const auto& mine : kept) {
    for (const owned_range& r : mine) {
      ++live;
      live_bytes += r.size;
      all_ranges[addr(r.ptr)] = r.size;
      CHECK(f.alloc.owns(r.ptr));
      CHECK(f.sim.is_device_memory(r.ptr, r.size));
    }
  }
  CHECK(all_ranges == registry.ranges());
  std::uintptr_t previous_end = 0;
  for (const auto& [address, size] : all_ranges) {
    CHECK(address >= previous_end);
    previous_end = address + size;
  }
  const device_stats st = f.stats();
  CHECK(all(st.allocation) == static_cast<std::int64_t>(live));
  CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(live_bytes));
  f.check_consistent();

  for (const auto& mine : kept) {
    for (const owned_range& r : mine) f.alloc.free(r.ptr);
  }
  f.alloc.empty_cache();
  CHECK(all(f.stats().reserved_bytes) == 0);
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}
