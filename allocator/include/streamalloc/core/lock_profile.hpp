// lock_profile: built with STREAMALLOC_LOCK_PROFILE=ON, adaptive_mutex
// measures how long holders keep it and contended callers wait for it, and
// prints the totals when it is destroyed: what tells a long critical section
// from a long queue (bench/RESULTS.md, "The lock under threads"). Otherwise
// every member is empty and compiles away.
#pragma once

#if STREAMALLOC_LOCK_PROFILE
#include <chrono>
#include <cstdint>
#include <cstdio>
#endif

namespace streamalloc {

#if STREAMALLOC_LOCK_PROFILE

// On a cache line of its own, so its counting does not slow the spinners
// reading the lock word beside it.
class alignas(64) lock_profile {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  static time_point now() { return std::chrono::steady_clock::now(); }

  lock_profile() = default;
  lock_profile(const lock_profile&) = delete;
  lock_profile& operator=(const lock_profile&) = delete;
  ~lock_profile() {
    if (locks_ == 0) return;
    std::fprintf(stderr,
                 "streamalloc lock profile: %llu locks, %llu contended (%.1f%%), held %.1f ns on average, "
                 "a contended lock waited %.1f ns on average\n",
                 static_cast<unsigned long long>(locks_), static_cast<unsigned long long>(contended_),
                 100.0 * static_cast<double>(contended_) / static_cast<double>(locks_),
                 static_cast<double>(hold_ns_) / static_cast<double>(locks_),
                 contended_ == 0 ? 0.0 : static_cast<double>(wait_ns_) / static_cast<double>(contended_));
  }

  // Called by the new holder: `asked` is when it started to lock.
  void acquired(bool contended, time_point asked) {
    held_since_ = now();
    ++locks_;
    if (contended) {
      ++contended_;
      wait_ns_ += nanoseconds(held_since_ - asked);
    }
  }
  // Called by the holder just before it unlocks.
  void releasing() { hold_ns_ += nanoseconds(now() - held_since_); }

 private:
  static std::uint64_t nanoseconds(std::chrono::steady_clock::duration d) {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  }

  // Written only by the lock's holder, so they need no atomics.
  time_point held_since_{};
  std::uint64_t locks_ = 0;
  std::uint64_t contended_ = 0;
  std::uint64_t hold_ns_ = 0;
  std::uint64_t wait_ns_ = 0;
};

#else

class lock_profile {
 public:
  struct time_point {};
  static time_point now() { return {}; }
  void acquired(bool, time_point) {}
  void releasing() {}
};

#endif

}  // namespace streamalloc
