// Note [combined calls]: a call that finds the allocator's lock taken is
// run by the thread holding it, with its result or exception handed back;
// not while a trace listener is set; and a forked child drops the calls
// its parent's threads left. The holder here is a thread whose growth the
// simulated device holds up inside allocate_segment (the allocator's lock
// held), so each test knows which thread holds the lock and which waits.
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/core/trace.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::consistency_problem;
using streamalloc::test::find_segment;
using streamalloc::test::immediate_events;
using streamalloc::test::make_two_holes;
using streamalloc::test::sim_fixture;
using streamalloc::test::vmm_device;

namespace {

// Holds the thread that runs hook() until open().
class gate {
 public:
  std::function<void()> hook() {
    return [this] {
      std::unique_lock<std::mutex> lock(mutex_);
      held_ = true;
      changed_.notify_all();
      changed_.wait(lock, [this] { return open_; });
    };
  }
  void wait_until_held() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return held_; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool held_ = false;
  bool open_ = false;
};

// Waits until a call is listed for the lock's holder; false after a while.
bool wait_for_listed_call(const caching_allocator& alloc) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!alloc.calls_waiting()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Runs `waiting_call` on a thread of its own while `holder_call`, on
// another, holds the allocator's lock inside its next device allocation
// (holder_call must make one); opens the gate once the call is listed.
void with_lock_held(sim_fixture& f, const std::function<void()>& holder_call,
                    const std::function<void()>& waiting_call) {
  gate g;
  f.sim.on_next_memory_allocation(g.hook());
  std::thread holder(holder_call);
  g.wait_until_held();
  std::thread waiter(waiting_call);
  const bool listed = wait_for_listed_call(f.alloc);
  g.open();
  holder.join();
  waiter.join();
  REQUIRE(listed);
}

// The same with a request for `grow_bytes` on s1 (which needs a new
// segment) holding the lock. Returns the grown pointer.
void* with_lock_held(sim_fixture& f, std::size_t grow_bytes, const std::function<void()>& waiting_call) {
  void* grown = nullptr;
  with_lock_held(f, [&] { grown = f.alloc.allocate(grow_bytes, f.s1); }, waiting_call);
  return grown;
}

struct thread_recorder final : trace_listener {
  void on_trace(const trace_event* events, std::size_t count) override {
    std::lock_guard<std::mutex> lock(mutex);
    for (std::size_t i = 0; i < count; ++i) seen.push_back({events[i], std::this_thread::get_id()});
  }
  struct entry {
    trace_event event;
    std::thread::id thread;
  };
  std::mutex mutex;
  std::vector<entry> seen;
};

}  // namespace

TEST_CASE("combined calls: the lock's holder runs an allocate and a free that wait for it", "[threads][combined]") {
  sim_fixture f(immediate_events(1_GiB));
  void* kept = f.alloc.allocate(4_KiB, f.s2);
  void* cached = f.alloc.allocate(8_KiB, f.s2);
  f.alloc.free(cached);

  std::atomic<bool> freed{false};
  void* grown = with_lock_held(f, 40_MiB, [&] {
    f.alloc.free(kept);
    freed.store(true);
  });
  CHECK(freed.load());
  CHECK(f.stats().num_combined_calls == 1);
  CHECK_FALSE(f.alloc.owns(kept));

  void* served = nullptr;
  void* grown_again = with_lock_held(f, 60_MiB, [&] { served = f.alloc.allocate(8_KiB, f.s2); });
  REQUIRE(served != nullptr);
  CHECK(f.alloc.owns(served));
  CHECK(f.alloc.allocation_size(served) == 8_KiB);

  const device_stats st = f.stats();
  CHECK(st.num_combined_calls == 2);
  CHECK(all(st.allocation) == 3);
  CHECK(all(st.allocated_bytes) == static_cast<std::int64_t>(40_MiB + 60_MiB + 8_KiB));
  f.check_consistent();
  for (void* p : {grown, grown_again, served}) f.alloc.free(p);
  f.alloc.empty_cache();
  CHECK(f.sim.used_bytes() == 0);
  f.check_consistent();
}

TEST_CASE("combined calls: a holder returns once it has run its share, with calls still listed",
          "[threads][combined]") {
  // Every call the holder runs grows a segment, and the sim's hook lists
  // the next thread's call before that growth goes on: the list is never
  // empty while the chain lasts, so only the holder's budget lets its own
  // caller return before the chain ends.
  allocator_config cfg;
  cfg.expandable_segments = false;  // every request below grows a segment
  sim_fixture f(immediate_events(16_GiB), cfg);
  constexpr int chain = caching_allocator::k_combined_calls_per_hold + 64;
  std::vector<std::promise<void>> go(chain);
  std::vector<void*> served(chain, nullptr);
  std::vector<std::thread> callers;
  for (int k = 0; k < chain; ++k) {
    callers.emplace_back([&, k] {
      go[static_cast<std::size_t>(k)].get_future().wait();
      served[static_cast<std::size_t>(k)] = f.alloc.allocate(12_MiB, f.s2);
    });
  }
  // The calls of the chain let go so far; the hook lets the next one go,
  // and the test body lets go the rest should the chain break.
  std::mutex go_mutex;
  int listed = 0;
  const auto let_go = [&]() -> bool {
    std::lock_guard<std::mutex> lock(go_mutex);
    if (listed == chain) return false;
    go[static_cast<std::size_t>(listed++)].set_value();
    return true;
  };
  // Growths run on the holder's thread: its own, and those of the calls
  // it ran for the chain. Counted under the allocator's lock.
  std::thread::id holder_id;
  int growths_on_holder = 0;
  std::function<void()> list_next = [&] {
    f.sim.on_next_memory_allocation(list_next);
    if (std::this_thread::get_id() == holder_id) ++growths_on_holder;
    if (!let_go()) return;
    while (!f.alloc.calls_waiting()) std::this_thread::yield();
  };
  f.sim.on_next_memory_allocation(list_next);
  void* own = nullptr;  // kept until the end, so each call of the chain grows
  std::thread holder([&] {
    holder_id = std::this_thread::get_id();
    own = f.alloc.allocate(40_MiB, f.s1);
  });
  holder.join();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int listed_in_the_end = 0;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(go_mutex);
      listed_in_the_end = listed;
    }
    if (listed_in_the_end == chain || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::yield();
  }
  while (let_go()) {
  }
  for (std::thread& t : callers) t.join();
  f.sim.on_next_memory_allocation(nullptr);
  // The holder grew for its own call and ran the first
  // k_combined_calls_per_hold calls of the chain; the next call's caller
  // took the lock once the holder left, and so on to the chain's end.
  CHECK(growths_on_holder == 1 + caching_allocator::k_combined_calls_per_hold);
  CHECK(listed_in_the_end == chain);
  CHECK(f.stats().num_combined_calls >= caching_allocator::k_combined_calls_per_hold);
  f.alloc.free(own);
  for (void* p : served) {
    CHECK(f.alloc.owns(p));
    f.alloc.free(p);
  }
  f.check_consistent();
}

TEST_CASE("combined calls: a combined call's exception reaches its own caller", "[threads][combined]") {
  sim_fixture f(immediate_events(1_GiB));
  void* kept = f.alloc.allocate(4_KiB, f.s2);
  std::string message;
  bool threw_usage_error = false;
  void* grown = with_lock_held(f, 40_MiB, [&] {
    try {
      f.alloc.free(static_cast<char*>(kept) + 512);  // inside a live block, not its start
    } catch (const usage_error& e) {
      threw_usage_error = true;
      message = e.what();
    }
  });
  CHECK(threw_usage_error);
  CHECK(message.find("pointer") != std::string::npos);
  CHECK(f.stats().num_combined_calls == 1);
  CHECK(f.alloc.owns(kept));
  CHECK(f.alloc.owns(grown));  // the holder's own call was not disturbed
  f.alloc.free(kept);
  f.alloc.free(grown);
  f.check_consistent();
}

TEST_CASE("combined calls: with a trace listener each call runs and delivers on its own thread",
          "[threads][combined]") {
  sim_fixture f(immediate_events(1_GiB));
  thread_recorder recorder;
  f.alloc.set_trace_listener(&recorder);
  void* kept = f.alloc.allocate(4_KiB, f.s2);
  std::thread::id waiter_id;
  void* grown = with_lock_held(f, 40_MiB, [&] {
    waiter_id = std::this_thread::get_id();
    f.alloc.free(kept);
  });
  f.alloc.set_trace_listener(nullptr);
  CHECK(f.stats().num_combined_calls == 0);
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(recorder.mutex);
    for (const thread_recorder::entry& e : recorder.seen) {
      if (e.event.action != trace_action::free_requested || e.event.address != addr(kept)) continue;
      found = true;
      CHECK(e.thread == waiter_id);
    }
  }
  CHECK(found);
  f.alloc.free(grown);
  f.check_consistent();
}

TEST_CASE("combined calls: a forked child drops the calls its parent's threads left", "[fork][combined]") {
  sim_fixture f(immediate_events(1_GiB));
  void* kept = f.alloc.allocate(4_KiB, f.s2);
  f.alloc.lock_for_fork();
  std::thread waiter([&] { f.alloc.free(kept); });
  const bool listed = wait_for_listed_call(f.alloc);
  const pid_t child = fork();
  if (child == 0) {
    // The waiter does not exist here: its free must not run, and the
    // allocator must work.
    f.alloc.unlock_after_fork();
    int code = 0;
    if (f.alloc.calls_waiting()) code = 1;
    if (code == 0 && !f.alloc.owns(kept)) code = 2;
    if (code == 0) {
      void* p = f.alloc.allocate(64_KiB, f.s1);
      f.alloc.free(p);
      if (!consistency_problem(f.alloc, f.sim).empty()) code = 3;
    }
    _exit(code);
  }
  f.alloc.unlock_after_fork();
  waiter.join();
  REQUIRE(listed);
  REQUIRE(child > 0);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  INFO("child exit codes: 1 a call still listed, 2 the parent's free ran, 3 inconsistent");
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_FALSE(f.alloc.owns(kept));
  f.check_consistent();
}

namespace {

// Note [stitching under contention]: 12 MiB mapped on s1 (make_two_holes:
// four idle chunks), then 2 MiB on s2. With stitch_slack:0.4 and no
// cross-stream reuse, the 2 MiB grows without a stitch, and an 8 MiB
// request on s1 afterwards wants one (22 MiB reserved would pass 1.4
// times the 14 MiB peak).
allocator_config contention_config() { return allocator_config::parse("stitch_slack:0.4,cross_stream_reuse:False"); }

struct two_requests {
  void* on_s2 = nullptr;
  void* big = nullptr;
};

// The 2 MiB request holds the lock in its chunk creation while the 8 MiB
// one waits for it, so the holder runs the 8 MiB request.
two_requests request_while_waiting(sim_fixture& f) {
  make_two_holes(f, f.s1);
  REQUIRE(all(f.stats().reserved_bytes) == static_cast<std::int64_t>(12_MiB));
  two_requests r;
  with_lock_held(f, [&] { r.on_s2 = f.alloc.allocate(2_MiB, f.s2); }, [&] { r.big = f.alloc.allocate(8_MiB, f.s1); });
  REQUIRE(r.on_s2 != nullptr);
  REQUIRE(r.big != nullptr);
  REQUIRE(f.stats().num_combined_calls == 1);
  return r;
}

}  // namespace

TEST_CASE("stitching under contention: a request run for a waiting thread maps new chunks instead",
          "[threads][combined][expandable]") {
  SECTION("one thread at a time: the request stitches the holes") {
    sim_fixture f(vmm_device(), contention_config());
    make_two_holes(f, f.s1);
    void* on_s2 = f.alloc.allocate(2_MiB, f.s2);
    CHECK(f.stats().num_stitched_blocks == 0);
    void* big = f.alloc.allocate(8_MiB, f.s1);
    const device_stats st = f.stats();
    CHECK(st.num_stitched_blocks == 1);
    CHECK(st.num_chunk_unmaps == 4);
    CHECK(all(st.reserved_bytes) == static_cast<std::int64_t>(14_MiB));
    f.check_consistent();
    f.alloc.free(big);
    f.alloc.free(on_s2);
  }
  SECTION("the same request waiting for the lock's holder: new chunks, no stitch") {
    sim_fixture f(vmm_device(), contention_config());
    const two_requests r = request_while_waiting(f);
    const device_stats st = f.stats();
    CHECK(st.num_stitched_blocks == 0);
    CHECK(st.num_chunk_unmaps == 0);
    CHECK(st.num_stitch_syncs == 0);
    CHECK(all(st.reserved_bytes) == static_cast<std::int64_t>(22_MiB));
    f.check_consistent();
    f.alloc.free(r.big);
    f.alloc.free(r.on_s2);
    f.check_consistent();
  }
}

TEST_CASE("stitching under contention: what the device cannot give is still stitched",
          "[threads][combined][expandable]") {
  // Room for 16 MiB of chunks: after the 14 MiB above, one more chunk, so
  // the waiting 8 MiB request maps one new chunk and stitches three.
  sim_fixture f(vmm_device(16_MiB), contention_config());
  const two_requests r = request_while_waiting(f);
  const device_stats st = f.stats();
  CHECK(st.num_stitched_blocks == 1);
  CHECK(st.num_chunk_unmaps == 3);
  CHECK(all(st.reserved_bytes) == static_cast<std::int64_t>(16_MiB));
  f.check_consistent();
  const allocator_snapshot snap = f.snapshot();
  const segment_info* seg = find_segment(snap, addr(r.big));
  REQUIRE(seg != nullptr);
  CHECK(seg->is_stitched);
  f.alloc.free(r.big);
  f.alloc.free(r.on_s2);
  f.check_consistent();
}

TEST_CASE("combined calls: a thread without a slot queues on the lock", "[threads][combined]") {
  sim_fixture f(immediate_events(1_GiB));
  void* kept = f.alloc.allocate(4_KiB, f.s2);

  // Threads take slots until one finds none left; it makes the call.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> go;
  std::shared_future<void> may_free = go.get_future().share();
  std::atomic<bool> freed{false};
  std::vector<std::thread> holders;
  bool slotless = false;
  for (int i = 0; i <= k_combiner_slots && !slotless; ++i) {
    std::promise<int> slot;
    std::future<int> got = slot.get_future();
    holders.emplace_back([&, p = std::move(slot)]() mutable {
      const int mine = combiner_thread_slot();
      p.set_value(mine);
      if (mine < 0) {
        may_free.wait();
        f.alloc.free(kept);
        freed.store(true);
      }
      released.wait();
    });
    slotless = got.get() < 0;
  }
  REQUIRE(slotless);

  gate g;
  f.sim.on_next_memory_allocation(g.hook());
  void* grown = nullptr;
  std::thread holder([&] { grown = f.alloc.allocate(40_MiB, f.s1); });
  g.wait_until_held();
  go.set_value();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(freed.load());  // waits for the lock, listed nowhere
  CHECK_FALSE(f.alloc.calls_waiting());
  g.open();
  holder.join();
  release.set_value();
  for (std::thread& t : holders) t.join();
  CHECK(freed.load());
  CHECK_FALSE(f.alloc.owns(kept));
  CHECK(f.stats().num_combined_calls == 0);
  f.alloc.free(grown);
  f.check_consistent();
}
