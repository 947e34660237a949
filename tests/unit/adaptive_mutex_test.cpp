// adaptive_mutex: mutual exclusion on its spinning and its sleeping path,
// and no lost wake-up (a lost one hangs the test until ctest's timeout).
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "streamalloc/core/adaptive_mutex.hpp"
#include "support/catch.hpp"

using streamalloc::adaptive_mutex;

namespace {

// Each thread adds `per_thread` to a plain counter under the lock; with
// `hold` each one sometimes keeps the lock long enough that the others
// stop spinning and sleep.
long count_under_lock(int threads, int per_thread, std::chrono::microseconds hold) {
  adaptive_mutex mutex;
  long counter = 0;
  std::atomic<bool> go{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (int i = 0; i < per_thread; ++i) {
        mutex.lock();
        ++counter;
        if (hold.count() != 0 && i % 64 == 0) std::this_thread::sleep_for(hold);
        mutex.unlock();
      }
    });
  }
  go.store(true, std::memory_order_release);
  for (std::thread& w : workers) w.join();
  return counter;
}

}  // namespace

TEST_CASE("adaptive_mutex: counts stay exact under contention", "[threads][adaptive_mutex]") {
  CHECK(count_under_lock(8, 4000, std::chrono::microseconds(0)) == 8L * 4000);
}

TEST_CASE("adaptive_mutex: sleeping waiters are woken", "[threads][adaptive_mutex]") {
  CHECK(count_under_lock(6, 640, std::chrono::microseconds(200)) == 6L * 640);
}

TEST_CASE("adaptive_mutex: a lock held long wakes every sleeper in turn", "[threads][adaptive_mutex]") {
  adaptive_mutex mutex;
  int entered = 0;
  mutex.lock();
  std::vector<std::thread> waiters;
  for (int t = 0; t < 4; ++t) {
    waiters.emplace_back([&] {
      mutex.lock();
      ++entered;
      mutex.unlock();
    });
  }
  // Far longer than the spin, so every waiter goes to sleep.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(entered == 0);
  mutex.unlock();
  for (std::thread& w : waiters) w.join();
  CHECK(entered == 4);
}

TEST_CASE("adaptive_mutex: try_lock fails while held", "[adaptive_mutex]") {
  adaptive_mutex mutex;
  REQUIRE(mutex.try_lock());
  std::thread other([&] { CHECK_FALSE(mutex.try_lock()); });
  other.join();
  mutex.unlock();
  CHECK(mutex.try_lock());
  mutex.unlock();
}
