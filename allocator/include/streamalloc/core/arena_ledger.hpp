// arena_ledger: what the arenas of one device share (Note [arenas] in
// device_allocator.cpp): the device's statistics, whose peaks are of the
// sum over arenas; each arena's reserved bytes, so that the memory-fraction
// cap holds for the device; the lock growth takes; and the way an arena
// out of memory reaches the others' caches.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "streamalloc/core/config.hpp"
#include "streamalloc/core/stats.hpp"

namespace streamalloc {

class arena_ledger {
 public:
  static constexpr int k_max_arenas = static_cast<int>(allocator_config::k_max_arenas);

  // The device's current and peak counts, whose peaks are of the sum over
  // arenas (the cumulative ones are the arenas' own, summed by readers).
  // Arena 0's counts become the device's, peaks included.
  void seed(const device_stats& first);
  // Adds how the current counts of an arena moved since its last publish
  // (`last`, updated) to the device's and raises their peaks. Called by
  // the arena at the end of each critical section, so the sums run through
  // the calls in an order they could have run in under one lock.
  // `held` is what the arena's recent frees (Note [recent frees]) keep
  // counted as allocated and active, left out here: they are free.
  struct held_back {
    std::array<std::int64_t, 2> blocks{};  // index: the segment is small
    std::array<std::int64_t, 2> bytes{};
  };
  void publish(device_stats& last, const device_stats& now, const held_back& held);
  // The device's counts: current and peak of every counter (the rest of
  // the fields as seeded, for the caller to fill in).
  device_stats totals() const;
  // Peaks to current values (the arenas reset their own).
  void reset_peaks();
  // The counts' lock, held across fork() (device_allocator::lock_for_fork).
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

  // Each arena's reserved bytes, written by the arena after it changes.
  void set_reserved(int arena, std::int64_t bytes) { reserved_[arena].store(bytes, std::memory_order_relaxed); }
  std::int64_t reserved_elsewhere(int arena) const;
  // Held by an arena from its cap check until its reserved bytes are
  // written back, so arenas growing at once cannot pass the cap together.
  std::mutex& growth_mutex() { return growth_mutex_; }

  // Set by the device allocator: frees other arenas' cached memory for
  // `arena`, which holds its own lock; true when anything was released.
  using release_elsewhere_fn = std::function<bool(int arena)>;
  void set_release_elsewhere(release_elsewhere_fn fn) { release_elsewhere_ = std::move(fn); }
  bool release_elsewhere(int arena) const { return release_elsewhere_ && release_elsewhere_(arena); }

 private:
  mutable std::mutex mutex_;  // guards totals_
  device_stats totals_;
  std::array<std::atomic<std::int64_t>, k_max_arenas> reserved_{};
  std::mutex growth_mutex_;
  release_elsewhere_fn release_elsewhere_;
};

}  // namespace streamalloc
