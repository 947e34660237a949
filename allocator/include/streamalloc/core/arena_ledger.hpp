// arena_ledger: what the arenas of one device share (Note [arenas] in
// device_allocator.cpp): the device's current and peak counts, whose peaks
// are of the sum over arenas; each arena's reserved bytes, so that the
// memory-fraction cap holds for the device; the lock growth takes; and the
// way an arena out of memory reaches the others' caches.
//
// Note [peak headroom]: an exact peak of a sum needs every change in one
// order, but a shared counter written by every call would bring back the
// contention arenas remove. So each arena holds, per counter, a share of
// the headroom between the device's peak and its current sum, kept as a
// ceiling (its current count plus its share): a change that stays at or
// under the ceiling needs only a lock of that arena's alone, and while
// every arena stays under its ceiling the sum cannot pass the peak. An
// increase beyond the ceiling (a crossing) takes the ledger's lock,
// gathers every arena's share (each ceiling down to its current count),
// raises the peak by what is still missing, and deals what is left out
// evenly. Invariant, per counter: peak = sum of ceilings, each ceiling >=
// its arena's current count.
//
// Note [claimed repeats]: an arena's lock-free repeat (Note [repeats
// without the lock] in caching_allocator.cpp) parks a freed block without
// a critical section, so the arena's published counts still hold it until
// its next section. Only a raised peak or a reader could tell: so a
// crossing, a reader of the totals and a reset of the peaks first claim
// every arena's parked block (repeat_slot::claim, under that arena's share
// lock), which then can no longer be taken back, and move its counts out
// of the arena's current ones into its share of headroom, as a publish of
// its free would. The arena's own publishes leave a claimed block out
// until its next section frees it for real. A block parked is freed in
// the order of calls: the claim puts that free before whatever the
// claimer does next.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "streamalloc/core/adaptive_mutex.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/core/repeat_slot.hpp"
#include "streamalloc/core/stats.hpp"

namespace streamalloc {

class arena_ledger {
 public:
  static constexpr int k_max_arenas = static_cast<int>(allocator_config::k_max_arenas);
  // Every current/peak counter of device_stats: the arrays' entries, then
  // the single counters.
  static constexpr int k_counters =
      static_cast<int>(std::size(device_stats::k_arrays)) * k_stat_type_count +
      static_cast<int>(std::size(device_stats::k_counters));
  using counts = std::array<std::int64_t, k_counters>;

  // What an arena's recent frees (Note [recent frees]) keep counted as
  // allocated and active: left out of what it publishes, they are free.
  struct held_back {
    std::array<std::int64_t, 2> blocks{};  // index: the segment is small
    std::array<std::int64_t, 2> bytes{};
  };
  // Where `array`'s entry of `type` is in a counts.
  static constexpr std::size_t index_of(stat_array device_stats::*array, stat_type type) {
    std::size_t index = 0;
    for (stat_array device_stats::*candidate : device_stats::k_arrays) {
      if (candidate == array) break;
      index += k_stat_type_count;
    }
    return index + static_cast<std::size_t>(type);
  }
  // The counts an arena publishes: its current ones less what it holds back.
  static counts current_counts(const device_stats& stats, const held_back& held);

  // Arena 0's counts become the device's, peaks included. `repeats`: the
  // arena's repeat slot, for claims (Note [claimed repeats]); may be null.
  void seed(const device_stats& first, repeat_slot* repeats = nullptr);
  // Arena `arena` (> 0, fresh: nothing counted) joins.
  void join(int arena, repeat_slot* repeats = nullptr);
  // Moves arena `arena`'s published counts to `now` (Note [peak headroom]).
  // Called by the arena at the end of each critical section, so the sums
  // run through the calls in an order they could have run in under one
  // lock.
  void publish(int arena, const counts& now);
  // publish(arena, current_counts(stats, held)), the counts built in place.
  void publish(int arena, const device_stats& stats, const held_back& held);
  // What arena `arena` published last, less what claims moved out since.
  counts published(int arena) const;
  // The device's current and peak counts (everything else zero).
  device_stats totals() const;
  // Peaks to the current sums.
  void reset_peaks();
  // Throws std::logic_error unless the invariant of Note [peak headroom]
  // holds and `arena_sums` (current counts summed over the arenas, read
  // while nothing runs) are the device's.
  void validate(const counts& arena_sums) const;

  // Each arena's reserved bytes, written by the arena after it changes.
  void set_reserved(int arena, std::int64_t bytes) { reserved_[arena].store(bytes, std::memory_order_relaxed); }
  std::int64_t reserved_elsewhere(int arena) const;
  // Held by an arena from its cap check until its reserved bytes are
  // written back, so arenas growing at once cannot pass the cap together.
  std::mutex& growth_mutex() { return growth_mutex_; }

  // Why an arena asks the others for their cached memory: out of memory,
  // they first complete their pending frees and the arenas after it are
  // waited for; for garbage collection, each returns only what is cached
  // now and only if its lock is free.
  enum class release_reason { out_of_memory, collection };
  // Set by the device allocator: frees other arenas' cached memory for
  // `arena`, which holds its own lock; true when anything was released.
  using release_elsewhere_fn = std::function<bool(int arena, release_reason why)>;
  void set_release_elsewhere(release_elsewhere_fn fn) { release_elsewhere_ = std::move(fn); }
  bool release_elsewhere(int arena, release_reason why) const {
    return release_elsewhere_ && release_elsewhere_(arena, why);
  }

  // The ledger's lock, held across fork() (device_allocator::lock_for_fork;
  // a share's lock is only held inside it or by a thread holding its
  // arena's lock).
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

 private:
  // One arena's part, on cache lines of its own.
  struct alignas(64) share {
    void lock() {
      while (held.exchange(true, std::memory_order_acquire)) {
        while (held.load(std::memory_order_relaxed)) adaptive_mutex::pause();
      }
    }
    void unlock() { held.store(false, std::memory_order_release); }
    // The published counts and the buffer the next publish fills: a
    // publish that stays under the ceilings swaps them instead of copying.
    counts& current() { return counts_[front_]; }
    const counts& current() const { return counts_[front_]; }
    counts& next() { return counts_[front_ ^ 1]; }
    void swap_counts() { front_ ^= 1; }
    // The arena's parked block that a claim took, if any.
    const block* claimed() const { return repeats != nullptr ? repeats->claimed() : nullptr; }

    std::atomic<bool> held{false};
    counts ceiling{};  // current + this arena's share of the headroom
    repeat_slot* repeats = nullptr;

   private:
    std::array<counts, 2> counts_{};
    int front_ = 0;
  };
  // Under `s`'s lock: fill(&counts) writes the arena's counts, which become
  // its published ones (less a claimed block) unless one passes its
  // ceiling; false then, and nothing changed.
  template <typename fill_fn>
  static bool publish_under_ceilings(share& s, fill_fn&& fill);
  // Claims the parked block of share `s`, held, its counts moving out of
  // the current ones into the share of headroom (Note [claimed repeats]).
  static void claim_parked(share& s);
  // Claims every arena's parked block; the ledger's lock held.
  void claim_all_parked_locked() const;
  // A crossing: `arena` applies `now` with the ledger's lock held.
  void cross_locked(int arena, const counts& now);

  // Crossings, readers and resets; taken before any share's lock.
  mutable std::mutex mutex_;
  counts peak_{};
  int arenas_ = 1;  // arenas that joined
  mutable std::array<share, k_max_arenas> shares_;
  std::array<std::atomic<std::int64_t>, k_max_arenas> reserved_{};
  std::mutex growth_mutex_;
  release_elsewhere_fn release_elsewhere_;
};

}  // namespace streamalloc
