// Fork safety of caching_allocator on the simulated device: threads
// allocate and free while the main thread forks again and again. With the
// allocator locked around the fork (lock_for_fork / unlock_after_fork, as
// the process allocator's pthread_atfork handlers do) every child finds the
// lock free and the allocator consistent, and can use a fresh allocator.
// A child that hangs is killed after a timeout and fails the test.
#include <pthread.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <random>
#include <string>
#include <thread>
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

// Child exit codes: what went wrong in the child.
enum child_status : int {
  child_ok = 0,
  child_inherited_inconsistent = 10,
  child_inherited_unusable = 11,
  child_fresh_failed = 12,
  child_exception = 13,
};

// The allocators the atfork handlers lock; the handlers are registered once
// per process and lock whatever is registered at fork time.
struct fork_registry {
  std::mutex mutex;
  std::vector<caching_allocator*> allocators;
};

fork_registry& registry() {
  static fork_registry* const instance = [] {
    auto* created = new fork_registry;
    pthread_atfork(
        [] {
          fork_registry& r = registry();
          r.mutex.lock();
          for (caching_allocator* a : r.allocators) a->lock_for_fork();
        },
        [] {
          fork_registry& r = registry();
          for (auto it = r.allocators.rbegin(); it != r.allocators.rend(); ++it) (*it)->unlock_after_fork();
          r.mutex.unlock();
        },
        [] {
          fork_registry& r = registry();
          for (auto it = r.allocators.rbegin(); it != r.allocators.rend(); ++it) (*it)->unlock_after_fork();
          r.mutex.unlock();
        });
    return created;
  }();
  return *instance;
}

// Registers `alloc` with the fork handlers for the scope's lifetime.
class fork_registration {
 public:
  explicit fork_registration(caching_allocator& alloc) : alloc_(alloc) {
    fork_registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.allocators.push_back(&alloc_);
  }
  ~fork_registration() {
    fork_registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.allocators.clear();
  }
  fork_registration(const fork_registration&) = delete;
  fork_registration& operator=(const fork_registration&) = delete;

 private:
  caching_allocator& alloc_;
};

// What a forked child does; never returns. No Catch macros here: the child
// reports through its exit code only.
[[noreturn]] void run_child(caching_allocator& inherited, sim_backend& inherited_sim) {
  int code = child_ok;
  try {
    if (!consistency_problem(inherited, inherited_sim).empty()) {
      code = child_inherited_inconsistent;
    } else {
      // The inherited allocator is usable: its lock was released.
      void* p = inherited.allocate(64_KiB, 0);
      inherited.free(p);
      inherited.empty_cache();
      if (!consistency_problem(inherited, inherited_sim).empty()) code = child_inherited_unusable;
    }
    if (code == child_ok) {
      sim_backend fresh_sim(immediate_events(1_GiB));
      caching_allocator fresh(fresh_sim, allocator_config{});
      std::vector<void*> blocks;
      for (std::size_t bytes : {std::size_t{512}, 3_MiB, 40_MiB}) blocks.push_back(fresh.allocate(bytes, 0));
      for (void* b : blocks) fresh.free(b);
      fresh.empty_cache();
      if (!consistency_problem(fresh, fresh_sim).empty() || fresh_sim.used_bytes() != 0) code = child_fresh_failed;
    }
  } catch (...) {
    code = child_exception;
  }
  _exit(code);
}

// Stops and joins the worker threads when the test ends, also when a
// failed REQUIRE leaves the test early.
struct stop_and_join {
  std::atomic<bool>& stop;
  std::vector<std::thread>& workers;
  ~stop_and_join() {
    stop.store(true);
    for (std::thread& w : workers) {
      if (w.joinable()) w.join();
    }
  }
};

struct wait_outcome {
  bool exited = false;
  int exit_code = -1;
  bool timed_out = false;
};

// Polls the child until it exits or `timeout` passes (then kills it).
wait_outcome wait_with_timeout(pid_t child, std::chrono::milliseconds timeout) {
  wait_outcome outcome;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0) return outcome;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      outcome.timed_out = true;
      return outcome;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (WIFEXITED(status)) {
    outcome.exited = true;
    outcome.exit_code = WEXITSTATUS(status);
  }
  return outcome;
}

}  // namespace

TEST_CASE("fork: lock_for_fork keeps other threads out until unlock_after_fork", "[fork]") {
  sim_fixture f(immediate_events(1_GiB));
  f.alloc.lock_for_fork();
  std::atomic<bool> allocated{false};
  void* p = nullptr;
  std::thread other([&] {
    p = f.alloc.allocate(4_KiB, f.s1);
    allocated.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(allocated.load());
  f.alloc.unlock_after_fork();
  other.join();
  CHECK(allocated.load());
  CHECK(f.alloc.owns(p));
  f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("fork: a child forked while threads allocate never deadlocks and can allocate", "[fork]") {
  sim_backend sim(immediate_events(16_GiB));
  caching_allocator alloc(sim, allocator_config::parse("max_split_size_mb:64"));
  fork_registration registration(alloc);

  std::atomic<bool> stop{false};
  std::atomic<std::size_t> operations{0};
  std::vector<std::thread> workers;
  stop_and_join joiner{stop, workers};
  std::vector<stream_handle> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(sim.new_stream());
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      std::vector<void*> mine;
      const stream_handle own = streams[static_cast<std::size_t>(t)];
      while (!stop.load(std::memory_order_relaxed)) {
        if (mine.size() < 16 && rng() % 3 != 0) {
          const std::size_t sizes[] = {std::size_t{512}, 40_KiB, 2_MiB, 12_MiB, 80_MiB};
          mine.push_back(alloc.allocate(sizes[rng() % 5], own));
          if (rng() % 4 == 0) alloc.record_stream(mine.back(), streams[rng() % streams.size()]);
        } else if (!mine.empty()) {
          alloc.free(mine.back());
          mine.pop_back();
        }
        if (rng() % 64 == 0) alloc.empty_cache();
        operations.fetch_add(1, std::memory_order_relaxed);
      }
      for (void* p : mine) alloc.free(p);
    });
  }

  constexpr int k_forks = 40;
  int forked = 0;
  for (int i = 0; i < k_forks; ++i) {
    // Let the workers get into the allocator between forks.
    const std::size_t before = operations.load();
    while (operations.load() < before + 50) std::this_thread::yield();
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) run_child(alloc, sim);
    ++forked;
    const wait_outcome outcome = wait_with_timeout(child, std::chrono::seconds(20));
    CAPTURE(i, outcome.exit_code);
    INFO("child exit codes: 10 inherited allocator inconsistent, 11 unusable, 12 fresh allocator failed, 13 exception");
    REQUIRE_FALSE(outcome.timed_out);
    REQUIRE(outcome.exited);
    REQUIRE(outcome.exit_code == child_ok);
  }
  stop.store(true);
  for (std::thread& w : workers) w.join();
  CHECK(forked == k_forks);
  CHECK(operations.load() >= static_cast<std::size_t>(50 * k_forks));
  alloc.empty_cache();
  const std::string problem = consistency_problem(alloc, sim);
  INFO(problem);
  CHECK(problem.empty());
  CHECK(sim.used_bytes() == 0);
}
