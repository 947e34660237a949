// adaptive_mutex: the per-device allocator lock. Critical sections are a few
// hundred nanoseconds, far shorter than a sleep/wake through the kernel, so
// a contended lock first spins briefly before it blocks on a futex.
// Uncontended, locking and unlocking are one atomic instruction each,
// inlined: a pthread mutex call costs about as much again as the hot path
// it guards. Satisfies Lockable, so std::lock_guard works with it.
#pragma once

#include <atomic>
#include <cstdint>

#include "streamalloc/core/lock_profile.hpp"

namespace streamalloc {

class adaptive_mutex {
 public:
  adaptive_mutex() = default;
  adaptive_mutex(const adaptive_mutex&) = delete;
  adaptive_mutex& operator=(const adaptive_mutex&) = delete;

  void lock() {
    const lock_profile::time_point asked = lock_profile::now();
    int expected = k_unlocked;
    const bool contended =
        !state_.compare_exchange_strong(expected, k_locked, std::memory_order_acquire, std::memory_order_relaxed);
    if (contended) lock_contended();
    count_section();
    profile_.acquired(contended, asked);
  }
  bool try_lock() {
    int expected = k_unlocked;
    if (!state_.compare_exchange_strong(expected, k_locked, std::memory_order_acquire, std::memory_order_relaxed)) {
      return false;
    }
    count_section();
    profile_.acquired(false, lock_profile::now());
    return true;
  }
  // How often the lock has been taken, this time included: two critical
  // sections with acquisitions() n and n + 1 had nothing run between them.
  // Read without the lock, it tells whether a section began since one of
  // the holder's readings (Note [repeats without the lock] in
  // caching_allocator.cpp).
  std::uint64_t acquisitions() const { return acquisitions_.load(std::memory_order_acquire); }
  // A holder that runs another thread's call counts it as a section of its
  // own (Note [combined calls] in caching_allocator.cpp).
  void count_section() {
    acquisitions_.store(acquisitions_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  // Whether the lock was free a moment ago: a waiter polls this before it
  // tries, so that its retries do not take the lock's cache line away.
  bool looks_free() const { return state_.load(std::memory_order_relaxed) == k_unlocked; }
  // A spin-wait's pause, easier on the core's sibling and the memory bus.
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void unlock() {
    profile_.releasing();
    if (state_.exchange(k_unlocked, std::memory_order_release) == k_contended) wake_one();
  }

 private:
  // The futex protocol of Drepper's "Futexes Are Tricky": a
  // thread that may sleep marks the lock contended, and only an unlock
  // that finds it so pays for a wake-up call.
  static constexpr int k_unlocked = 0;
  static constexpr int k_locked = 1;     // no thread sleeps on it
  static constexpr int k_contended = 2;  // a thread may sleep on it

  void lock_contended();
  void wake_one();

  // Each on a cache line of its own: waiters poll the lock word while the
  // holder counts the sections it runs for them (Note [combined calls] in
  // caching_allocator.cpp), and neither may take the line from the other.
  alignas(64) std::atomic<int> state_{k_unlocked};
  alignas(64) std::atomic<std::uint64_t> acquisitions_{0};  // written only by the holder
  lock_profile profile_;
};

}  // namespace streamalloc
