// Trace events (torch's memory history) on the simulated device: the exact
// event sequence of each allocator action, pending frees completing late,
// segments, expandable-segment maps and unmaps (stitching included), the oom
// event arriving before the exception, listeners that call back into the
// allocator or unregister themselves, delivery from many threads, and a
// random workload whose events alone account for every reserved and
// allocated byte.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "streamalloc/core/trace.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using namespace streamalloc::test;

namespace {

// One line per event, so a mismatch prints both sequences readably.
std::string describe(trace_action action, std::uintptr_t address, std::size_t size, stream_handle stream,
                     pool_id pool = 0) {
  std::ostringstream out;
  out << to_string(action) << " 0x" << std::hex << address << std::dec << " " << size << " stream " << stream
      << " pool " << pool;
  return out.str();
}

std::string describe(trace_action action, const void* ptr, std::size_t size, stream_handle stream, pool_id pool = 0) {
  return describe(action, addr(ptr), size, stream, pool);
}

std::string describe(const trace_event& e) { return describe(e.action, e.address, e.size, e.stream, e.pool); }

// Records every event it receives, with the batch and the delivering thread.
class recorder : public trace_listener {
 public:
  void on_trace(const trace_event* events, std::size_t count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++batches_;
    for (std::size_t i = 0; i < count; ++i) {
      events_.push_back(events[i]);
      threads_.push_back(std::this_thread::get_id());
    }
  }
  // The events received since the last take(), described.
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const trace_event& e : events_) out.push_back(describe(e));
    events_.clear();
    threads_.clear();
    return out;
  }
  std::vector<trace_event> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }
  std::vector<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return threads_;
  }
  int batches() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batches_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<trace_event> events_;
  std::vector<std::thread::id> threads_;
  int batches_ = 0;
};

using lines = std::vector<std::string>;

}  // namespace

TEST_CASE("trace: actions are spelled as torch spells them", "[trace]") {
  CHECK(std::string(to_string(trace_action::alloc)) == "alloc");
  CHECK(std::string(to_string(trace_action::free_requested)) == "free_requested");
  CHECK(std::string(to_string(trace_action::free_completed)) == "free_completed");
  CHECK(std::string(to_string(trace_action::segment_alloc)) == "segment_alloc");
  CHECK(std::string(to_string(trace_action::segment_free)) == "segment_free");
  CHECK(std::string(to_string(trace_action::segment_map)) == "segment_map");
  CHECK(std::string(to_string(trace_action::segment_unmap)) == "segment_unmap");
  CHECK(std::string(to_string(trace_action::oom)) == "oom");
}

TEST_CASE("trace: alloc, free and empty_cache on plain segments", "[trace]") {
  sim_fixture f(plain_device());
  recorder r;
  f.alloc.set_trace_listener(&r);

  void* p = f.alloc.allocate(1000, f.s1);
  // The small segment is created, then its first block handed out; like
  // torch's history, entries carry the bytes asked for (the block is 1024).
  CHECK(r.take() == lines{describe(trace_action::segment_alloc, p, 2_MiB, f.s1),
                          describe(trace_action::alloc, p, 1000, f.s1)});
  void* q = f.alloc.allocate(1000, f.s1);  // same segment: no segment event
  CHECK(r.take() == lines{describe(trace_action::alloc, q, 1000, f.s1)});

  // No other stream used p: its memory is reusable at once.
  f.alloc.free(p);
  CHECK(r.take() == lines{describe(trace_action::free_requested, p, 1000, f.s1),
                          describe(trace_action::free_completed, p, 1000, f.s1)});
  f.alloc.free(q);
  CHECK(r.take() == lines{describe(trace_action::free_requested, q, 1000, f.s1),
                          describe(trace_action::free_completed, q, 1000, f.s1)});

  f.alloc.empty_cache();
  CHECK(r.take() == lines{describe(trace_action::segment_free, p, 2_MiB, f.s1)});
  f.alloc.empty_cache();  // nothing left to return
  CHECK(r.take().empty());

  // Calls that change nothing record nothing.
  (void)f.stats();
  (void)f.snapshot();
  f.alloc.validate();
  CHECK(r.take().empty());
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: a freed block with stream uses completes when its events do", "[trace]") {
  allocator_config own_streams;  // no cross-stream reuse: each stream grows its own segment
  own_streams.cross_stream_reuse = false;
  sim_fixture f(manual_events(), own_streams);
  recorder r;
  f.alloc.set_trace_listener(&r);
  void* p = f.alloc.allocate(4_MiB, f.s1);
  CHECK(r.take() == lines{describe(trace_action::segment_alloc, p, 20_MiB, f.s1),
                          describe(trace_action::alloc, p, 4_MiB, f.s1)});
  f.alloc.record_stream(p, f.s2);
  CHECK(r.take().empty());

  f.alloc.free(p);
  CHECK(r.take() == lines{describe(trace_action::free_requested, p, 4_MiB, f.s1)});
  // While s2's event is pending the block stays in use.
  void* other = f.alloc.allocate(2_MiB, f.s3);
  CHECK(r.take() == lines{describe(trace_action::segment_alloc, other, 20_MiB, f.s3),
                          describe(trace_action::alloc, other, 2_MiB, f.s3)});

  f.sim.complete_all_events();
  CHECK(r.take().empty());  // nothing happens until the allocator looks
  // The next allocation reclaims the block first, then serves the request
  // from it.
  void* again = f.alloc.allocate(4_MiB, f.s1);
  CHECK(again == p);
  CHECK(r.take() == lines{describe(trace_action::free_completed, p, 4_MiB, f.s1),
                          describe(trace_action::alloc, p, 4_MiB, f.s1)});

  // empty_cache waits for pending frees: free_completed comes before the
  // segment goes back.
  f.alloc.record_stream(again, f.s2);
  f.alloc.free(again);
  f.alloc.free(other);
  CHECK(r.take() == lines{describe(trace_action::free_requested, p, 4_MiB, f.s1),
                          describe(trace_action::free_requested, other, 2_MiB, f.s3),
                          describe(trace_action::free_completed, other, 2_MiB, f.s3)});
  f.alloc.empty_cache();
  const lines released = r.take();
  REQUIRE(released.size() == 3);
  CHECK(released[0] == describe(trace_action::free_completed, p, 4_MiB, f.s1));
  const lines segments(released.begin() + 1, released.end());
  CHECK(std::count(segments.begin(), segments.end(), describe(trace_action::segment_free, p, 20_MiB, f.s1)) == 1);
  CHECK(std::count(segments.begin(), segments.end(), describe(trace_action::segment_free, other, 20_MiB, f.s3)) ==
        1);
  f.check_consistent();
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: segments of a private pool carry the pool id", "[trace]") {
  sim_fixture f(plain_device());
  recorder r;
  f.alloc.set_trace_listener(&r);
  f.alloc.begin_allocate_to_pool(7, [](stream_handle) { return true; });
  void* p = f.alloc.allocate(12_MiB, f.s1);
  f.alloc.end_allocate_to_pool(7);
  f.alloc.free(p);
  // A released pool keeps its segment until its cache is emptied (as torch).
  f.alloc.release_pool(7);
  f.alloc.empty_cache(7);
  CHECK(r.take() == lines{describe(trace_action::segment_alloc, p, 12_MiB, f.s1, 7),
                          describe(trace_action::alloc, p, 12_MiB, f.s1, 7),
                          describe(trace_action::free_requested, p, 12_MiB, f.s1, 7),
                          describe(trace_action::free_completed, p, 12_MiB, f.s1, 7),
                          describe(trace_action::segment_free, p, 12_MiB, f.s1, 7)});
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: expandable segments map and unmap runs of chunks", "[trace][expandable]") {
  sim_fixture f(vmm_device());
  recorder r;
  f.alloc.set_trace_listener(&r);
  void* a = f.alloc.allocate(3_MiB, f.s1);
  // Two chunks mapped at the start of a fresh range; no segment_alloc.
  CHECK(r.take() == lines{describe(trace_action::segment_map, a, 4_MiB, f.s1),
                          describe(trace_action::alloc, a, 3_MiB, f.s1)});
  void* b = f.alloc.allocate(3_MiB, f.s1);
  REQUIRE(addr(b) == addr(a) + 3_MiB);
  // The free 1 MiB tail of a's chunks plus one new chunk.
  CHECK(r.take() == lines{describe(trace_action::segment_map, addr(a) + 4_MiB, 2_MiB, f.s1),
                          describe(trace_action::alloc, b, 3_MiB, f.s1)});
  f.alloc.free(a);
  f.alloc.free(b);
  CHECK(r.take() == lines{describe(trace_action::free_requested, a, 3_MiB, f.s1),
                          describe(trace_action::free_completed, a, 3_MiB, f.s1),
                          describe(trace_action::free_requested, b, 3_MiB, f.s1),
                          describe(trace_action::free_completed, b, 3_MiB, f.s1)});
  // The coalesced free block gives all three chunks back at once.
  f.alloc.empty_cache();
  CHECK(r.take() == lines{describe(trace_action::segment_unmap, a, 6_MiB, f.s1)});
  f.check_consistent();
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: a stitch unmaps the holes, then maps their chunks where the request goes", "[trace][expandable]") {
  sim_fixture f(vmm_device());
  void* hole1 = f.alloc.allocate(4_MiB, f.s1);
  void* kept1 = f.alloc.allocate(2_MiB, f.s1);
  void* hole2 = f.alloc.allocate(4_MiB, f.s1);
  void* kept2 = f.alloc.allocate(2_MiB, f.s1);
  f.alloc.free(hole1);
  f.alloc.free(hole2);
  recorder r;
  f.alloc.set_trace_listener(&r);
  void* big = f.alloc.allocate(8_MiB, f.s1);
  REQUIRE(f.stats().num_stitched_blocks == 1);
  REQUIRE(addr(big) == addr(kept2) + 2_MiB);
  CHECK(r.take() == lines{describe(trace_action::segment_unmap, hole1, 4_MiB, f.s1),
                          describe(trace_action::segment_unmap, hole2, 4_MiB, f.s1),
                          describe(trace_action::segment_map, big, 8_MiB, f.s1),
                          describe(trace_action::alloc, big, 8_MiB, f.s1)});
  for (void* p : {big, kept1, kept2}) f.alloc.free(p);
  f.check_consistent();
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: the oom event reaches the listener before the exception reaches the caller", "[trace]") {
  sim_fixture f(plain_device(64_MiB));
  void* p = f.alloc.allocate(40_MiB, f.s1);
  recorder r;
  f.alloc.set_trace_listener(&r);
  bool thrown = false;
  try {
    f.alloc.allocate(30_MiB, f.s2);
  } catch (const out_of_memory&) {
    thrown = true;
    // Torch's convention: the address field carries the device's free bytes.
    CHECK(r.take() == lines{describe(trace_action::oom, 24_MiB, 30_MiB, f.s2)});
    const std::vector<std::thread::id> threads = r.threads();
    const std::thread::id me = std::this_thread::get_id();
    CHECK(std::all_of(threads.begin(), threads.end(), [&](std::thread::id t) { return t == me; }));
  }
  CHECK(thrown);
  // A request no size can represent fails before rounding, with the event too.
  CHECK_THROWS_AS(f.alloc.allocate(SIZE_MAX, f.s1), out_of_memory);
  CHECK(r.take() == lines{describe(trace_action::oom, 24_MiB, SIZE_MAX, f.s1)});
  // A misuse is no event, and the allocator stays usable.
  CHECK_THROWS_AS(f.alloc.free(reinterpret_cast<void*>(addr(p) + 512)), usage_error);
  CHECK(r.take().empty());
  f.alloc.free(p);
  f.check_consistent();
  f.alloc.set_trace_listener(nullptr);
}

TEST_CASE("trace: a listener may call back into the allocator", "[trace]") {
  sim_fixture f(plain_device());
  // On each alloc event it reads the stats and allocates and frees a block
  // of its own (whose events it receives nested, and ignores).
  struct reentrant : trace_listener {
    caching_allocator* alloc = nullptr;
    stream_handle stream = 0;
    int depth = 0;
    int outer_allocs = 0;
    int nested_events = 0;
    std::int64_t allocated_seen = 0;
    void on_trace(const trace_event* events, std::size_t count) override {
      if (depth > 0) {
        nested_events += static_cast<int>(count);
        return;
      }
      ++depth;
      for (std::size_t i = 0; i < count; ++i) {
        if (events[i].action != trace_action::alloc) continue;
        ++outer_allocs;
        allocated_seen = alloc->stats().allocated_bytes[0].current;
        alloc->free(alloc->allocate(4_KiB, stream));
      }
      --depth;
    }
  } listener;
  listener.alloc = &f.alloc;
  listener.stream = f.s1;
  f.alloc.set_trace_listener(&listener);
  void* p = f.alloc.allocate(1_MiB, f.s1);
  CHECK(listener.outer_allocs == 1);
  CHECK(listener.allocated_seen == static_cast<std::int64_t>(1_MiB));  // the call had finished
  // alloc, free_requested, free_completed of the nested block, carved from
  // the outer block's segment.
  CHECK(listener.nested_events == 3);
  f.alloc.free(p);
  f.alloc.set_trace_listener(nullptr);
  f.check_consistent();
}

TEST_CASE("trace: a listener may unregister itself from on_trace", "[trace]") {
  sim_fixture f(plain_device());
  struct one_shot : trace_listener {
    caching_allocator* alloc = nullptr;
    int calls = 0;
    void on_trace(const trace_event*, std::size_t) override {
      ++calls;
      alloc->set_trace_listener(nullptr);  // must not wait for this very delivery
    }
  } listener;
  listener.alloc = &f.alloc;
  f.alloc.set_trace_listener(&listener);
  void* p = f.alloc.allocate(1_MiB, f.s1);
  f.alloc.free(p);
  CHECK(listener.calls == 1);
}

TEST_CASE("trace: no listener, no events", "[trace]") {
  sim_fixture f(plain_device());
  recorder r;
  void* before = f.alloc.allocate(1_MiB, f.s1);  // nothing recorded without a listener
  f.alloc.set_trace_listener(&r);
  f.alloc.set_trace_listener(&r);  // registering it again changes nothing
  f.alloc.free(before);
  CHECK(r.take().size() == 2);
  f.alloc.set_trace_listener(nullptr);
  void* p = f.alloc.allocate(3_MiB, f.s1);
  f.alloc.free(p);
  f.alloc.empty_cache();
  CHECK_THROWS_AS(f.alloc.allocate(SIZE_MAX, f.s1), out_of_memory);
  CHECK(r.take().empty());
  CHECK(r.batches() == 1);

  // A listener replaced by another receives nothing more.
  recorder second;
  f.alloc.set_trace_listener(&r);
  f.alloc.set_trace_listener(&second);
  f.alloc.free(f.alloc.allocate(1_MiB, f.s1));
  CHECK(r.take().empty());
  CHECK(second.take().size() == 4);
  f.alloc.set_trace_listener(nullptr);
  f.check_consistent();
}

TEST_CASE("trace: threads deliver their own events, in their call order", "[trace][threads]") {
  constexpr int k_threads = 4;
  constexpr int k_rounds = 200;
  sim_fixture f(immediate_events());
  recorder r;
  f.alloc.set_trace_listener(&r);
  std::vector<std::vector<std::uintptr_t>> pointers(k_threads);
  std::vector<std::thread::id> ids(k_threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < k_threads; ++t) {
    workers.emplace_back([&, t] {
      ids[static_cast<std::size_t>(t)] = std::this_thread::get_id();
      const stream_handle stream = t % 2 == 0 ? f.s1 : f.s2;
      for (int i = 0; i < k_rounds; ++i) {
        const std::size_t bytes = (static_cast<std::size_t>(i % 7) + 1) * 300_KiB;
        void* p = f.alloc.allocate(bytes, stream);
        pointers[static_cast<std::size_t>(t)].push_back(addr(p));
        f.alloc.free(p);
        if (i % 50 == 49) f.alloc.empty_cache();
      }
    });
  }
  for (std::thread& w : workers) w.join();
  f.alloc.set_trace_listener(nullptr);

  const std::vector<trace_event> events = r.events();
  const std::vector<std::thread::id> threads = r.threads();
  std::map<trace_action, int> counts;
  for (const trace_event& e : events) ++counts[e.action];
  CHECK(counts[trace_action::alloc] == k_threads * k_rounds);
  CHECK(counts[trace_action::free_requested] == k_threads * k_rounds);
  CHECK(counts[trace_action::free_completed] == k_threads * k_rounds);
  CHECK(counts[trace_action::segment_alloc] - counts[trace_action::segment_free] ==
        static_cast<int>(f.snapshot().segments.size()));
  // Each thread received exactly the events of its own calls, in order:
  // alloc, free_requested, free_completed of each of its pointers.
  for (int t = 0; t < k_threads; ++t) {
    std::vector<std::string> got;
    std::vector<std::string> want;
    for (std::size_t i = 0; i < events.size(); ++i) {
      const trace_event& e = events[i];
      if (threads[i] != ids[static_cast<std::size_t>(t)] || e.action == trace_action::segment_alloc ||
          e.action == trace_action::segment_free) {
        continue;
      }
      got.push_back(std::string(to_string(e.action)) + " " + std::to_string(e.address));
    }
    for (std::uintptr_t p : pointers[static_cast<std::size_t>(t)]) {
      for (const char* action : {"alloc", "free_requested", "free_completed"}) {
        want.push_back(std::string(action) + " " + std::to_string(p));
      }
    }
    INFO("thread " << t);
    CHECK(got == want);
  }
  f.check_consistent();
}

TEST_CASE("trace: a replaced listener is never called once set_trace_listener returns", "[trace][threads]") {
  // Workers allocate and free while another thread keeps swapping the
  // listener; a listener called after its replacement returned would be
  // called after its owner may have destroyed it.
  struct guarded : trace_listener {
    std::atomic<bool> registered{false};
    std::atomic<int> late{0};
    std::atomic<int> calls{0};
    void on_trace(const trace_event*, std::size_t) override {
      calls.fetch_add(1);
      if (!registered.load()) late.fetch_add(1);
    }
  };
  sim_fixture f(immediate_events());
  guarded a;
  guarded b;
  std::atomic<bool> stop{false};
  std::atomic<long> rounds{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      const stream_handle stream = t == 0 ? f.s1 : f.s2;
      while (!stop.load()) {
        f.alloc.free(f.alloc.allocate(64_KiB, stream));
        rounds.fetch_add(1);
      }
    });
  }
  for (int i = 0; i < 300; ++i) {
    guarded& next = i % 2 == 0 ? a : b;
    guarded& previous = i % 2 == 0 ? b : a;
    next.registered.store(true);
    f.alloc.set_trace_listener(&next);
    previous.registered.store(false);
    // Let the workers run a few calls under this listener.
    const long seen = rounds.load();
    while (rounds.load() < seen + 3) std::this_thread::yield();
    if (i % 3 == 0) {
      f.alloc.set_trace_listener(nullptr);
      next.registered.store(false);
    }
  }
  f.alloc.set_trace_listener(nullptr);
  a.registered.store(false);
  b.registered.store(false);
  stop.store(true);
  for (std::thread& w : workers) w.join();
  CHECK(a.late.load() == 0);
  CHECK(b.late.load() == 0);
  CHECK(a.calls.load() + b.calls.load() > 0);
  f.check_consistent();
}

namespace {

// The allocator's state as the events alone describe it: live blocks,
// blocks freed but not yet completed, and reserved bytes (plain segments
// plus mapped chunks). A torch memory_viz built from the events shows this.
class event_model {
 public:
  // "" while the events are consistent, else the first contradiction.
  std::string apply(const trace_event& e) {
    switch (e.action) {
      case trace_action::alloc:
        if (!live_.emplace(e.address, e.size).second) return "alloc of a live block";
        allocated_ += e.size;
        break;
      case trace_action::free_requested: {
        auto it = live_.find(e.address);
        if (it == live_.end() || it->second != e.size) return "free_requested of no live block";
        live_.erase(it);
        allocated_ -= e.size;
        if (!pending_.emplace(e.address, e.size).second) return "free_requested twice";
        break;
      }
      case trace_action::free_completed: {
        auto it = pending_.find(e.address);
        if (it == pending_.end() || it->second != e.size) return "free_completed without free_requested";
        pending_.erase(it);
        break;
      }
      case trace_action::segment_alloc:
      case trace_action::segment_map:
        reserved_ += e.size;
        break;
      case trace_action::segment_free:
      case trace_action::segment_unmap:
        if (e.size > reserved_) return "more memory returned than reserved";
        reserved_ -= e.size;
        break;
      case trace_action::oom:
        break;
    }
    return {};
  }
  std::size_t reserved() const { return reserved_; }
  std::size_t allocated() const { return allocated_; }
  std::size_t pending() const { return pending_.size(); }

 private:
  std::map<std::uintptr_t, std::size_t> live_;
  std::map<std::uintptr_t, std::size_t> pending_;
  std::size_t allocated_ = 0;
  std::size_t reserved_ = 0;
};

}  // namespace

TEST_CASE("trace: the events of a random workload account for every byte", "[trace][randomized]") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    INFO("seed " << seed);
    sim_config device = vmm_device(256_MiB, /*manual_events=*/seed % 2 == 0);
    device.virtual_memory = seed % 3 != 0;
    sim_fixture f(device);
    recorder r;
    f.alloc.set_trace_listener(&r);
    event_model model;
    std::mt19937_64 rng(seed);
    std::vector<std::pair<void*, stream_handle>> live;
    const stream_handle streams[] = {f.s1, f.s2, f.s3};
    std::size_t checked = 0;
    for (int step = 0; step < 1500; ++step) {
      const unsigned op = static_cast<unsigned>(rng() % 100);
      if (op < 45 || live.empty()) {
        const stream_handle stream = streams[rng() % 3];
        const std::size_t bytes = rng() % 4 == 0 ? 1 + rng() % 48_MiB : 1 + rng() % 600_KiB;
        try {
          live.emplace_back(f.alloc.allocate(bytes, stream), stream);
        } catch (const out_of_memory&) {
        }
      } else if (op < 85) {
        const std::size_t i = static_cast<std::size_t>(rng() % live.size());
        if (rng() % 3 == 0) f.alloc.record_stream(live[i].first, streams[rng() % 3]);
        f.alloc.free(live[i].first);
        live[i] = live.back();
        live.pop_back();
      } else if (op < 92) {
        f.sim.complete_all_events();
      } else if (op < 95) {
        f.alloc.empty_cache();
      } else {
        const char* settings[] = {"expandable_segments:False", "expandable_segments:True", "max_split_size_mb:64",
                                  "max_split_size_mb:unlimited", "roundup_power2_divisions:[1:4,>:2]"};
        f.alloc.update_config(f.alloc.config().with(settings[rng() % 5]));
      }
      for (const trace_event& e : r.events()) {
        const std::string problem = model.apply(e);
        INFO("step " << step << ": " << describe(e));
        REQUIRE(problem.empty());
      }
      r.take();
      const device_stats st = f.stats();
      REQUIRE(model.reserved() == static_cast<std::size_t>(all(st.reserved_bytes)));
      REQUIRE(model.allocated() == static_cast<std::size_t>(all(st.requested_bytes)));
      ++checked;
    }
    for (const auto& [p, stream] : live) f.alloc.free(p);
    f.sim.complete_all_events();
    f.alloc.empty_cache();
    for (const trace_event& e : r.events()) REQUIRE(model.apply(e).empty());
    CHECK(model.reserved() == 0);
    CHECK(model.allocated() == 0);
    CHECK(model.pending() == 0);  // torch's rule: every free completes
    CHECK(checked == 1500);
    f.alloc.set_trace_listener(nullptr);
    f.check_consistent();
  }
}

TEST_CASE("trace: empty_cache ends the trace with the memory it returned", "[trace][expandable]") {
  // torch's memory history tests read the last entry after empty_cache.
  sim_fixture f(vmm_device());
  recorder r;
  f.alloc.set_trace_listener(&r);
  void* big = f.alloc.allocate(2 * 311 * 411 * 4, f.s1);
  void* unused = f.alloc.allocate(310 * 410 * 4, f.s1);
  void* x = f.alloc.allocate(311 * 411 * 4, f.s1);
  f.alloc.free(big);
  std::vector<void*> small;
  for (int i = 0; i < 1000; ++i) small.push_back(f.alloc.allocate(512, f.s1));
  for (std::size_t i = 0; i < small.size(); ++i) f.alloc.free(small[(i * 7919) % small.size()]);
  f.alloc.free(f.alloc.allocate(128 * 5 * 4, f.s1));
  f.alloc.free(unused);
  f.alloc.free(x);
  r.take();
  f.alloc.empty_cache();
  const lines released = r.take();
  REQUIRE(!released.empty());
  INFO(released.back());
  CHECK(released.back().rfind("segment_unmap", 0) == 0);
  f.check_consistent();
  f.alloc.set_trace_listener(nullptr);
}
