// call_combiner: the calls waiting for the allocator's lock, one slot per
// thread, that the lock's holder runs (Note [combined calls] in
// caching_allocator.cpp). A caller that finds the lock taken writes its
// call into its own slot and waits on the slot's state; the holder, before
// it unlocks, scans the slots, runs the calls it finds and marks each one
// finished, so the allocator's state stays in the holder's cache instead
// of moving to every caller's core in turn. Slots instead of one shared
// list: callers then write only lines of their own, and the holder reads
// the waiting calls with independent loads rather than by chasing
// pointers through other cores' caches.
#pragma once

#include <atomic>
#include <memory>

namespace streamalloc {

// Slots per combiner: threads beyond this many at once queue on the lock.
constexpr int k_combiner_slots = 512;

// This thread's slot index, the same in every combiner and unique among
// the live threads that have one; taken on first use, given back when the
// thread exits. -1: none (all taken, or the thread is exiting).
int combiner_thread_slot();
// One past the highest slot index taken so far: holders scan this many.
int combiner_slots_in_use();

struct combiner_call {
  enum state_type : int {
    idle = 0,
    waiting,   // listed: the holder may run it
    done,      // the holder ran it
    declined,  // the holder left it to its caller, who must take the lock
  };
  std::atomic<int> state{idle};

  void finish(state_type how) { state.store(how, std::memory_order_release); }
  int poll() const { return state.load(std::memory_order_acquire); }
};

// `Call` derives from combiner_call and adds what the call is.
template <typename Call>
class call_combiner {
 public:
  call_combiner() : slots_(new slot[k_combiner_slots]), taken_(new std::atomic<bool>[k_combiner_slots]) {
    for (int i = 0; i < k_combiner_slots; ++i) taken_[i].store(false, std::memory_order_relaxed);
  }
  call_combiner(const call_combiner&) = delete;
  call_combiner& operator=(const call_combiner&) = delete;

  // This thread's call, to fill in and list; nullptr if it has no slot.
  Call* own_call() {
    const int i = combiner_thread_slot();
    return i < 0 ? nullptr : &slots_[i].call;
  }

  // Lists this thread's call, its arguments written. The hint is set
  // before the call is, so a holder that sees the call listed sees the
  // hint; and again after it, sequentially consistent with take()'s reset,
  // so a holder that reset the hint either found this call or left the
  // hint set for the next round.
  void list(Call& c) {
    raise_hint();
    c.state.store(combiner_call::waiting, std::memory_order_seq_cst);
    raise_hint();
  }

  // Under the lock: the slot indices of the listed calls into `out` (room
  // for k_combiner_slots), their number returned. Each stays taken, and
  // no longer counts as listed, until finish().
  int take(int* out) {
    maybe_listed_.store(false, std::memory_order_seq_cst);
    int n = 0;
    const int in_use = combiner_slots_in_use();
    for (int i = 0; i < in_use; ++i) {
      if (listed(i, std::memory_order_seq_cst)) {
        taken_[i].store(true, std::memory_order_relaxed);
        out[n++] = i;
      }
    }
    return n;
  }
  Call& at(int i) { return slots_[i].call; }
  // Under the lock: ends taken call `i`; its caller may return at once.
  void finish(int i, combiner_call::state_type how) {
    taken_[i].store(false, std::memory_order_relaxed);
    slots_[i].call.finish(how);
  }

  // A hint, read without the lock: false while no call was listed since
  // the last take(). A waiting caller does not rely on it: it takes the
  // lock itself once the lock is free.
  bool maybe_listed() const { return maybe_listed_.load(std::memory_order_relaxed); }

  // Whether a call is listed and not taken (a scan of the slots in use).
  bool any_listed() const {
    const int in_use = combiner_slots_in_use();
    for (int i = 0; i < in_use; ++i) {
      if (listed(i, std::memory_order_acquire)) return true;
    }
    return false;
  }

  // Forgets the listed calls without running them: in a forked child,
  // whose only thread is the one that forked, their callers do not exist.
  void forget_all() {
    for (int i = 0; i < k_combiner_slots; ++i) {
      slots_[i].call.state.store(combiner_call::idle, std::memory_order_relaxed);
      taken_[i].store(false, std::memory_order_relaxed);
    }
    maybe_listed_.store(false, std::memory_order_relaxed);
  }

 private:
  // Slot `i` holds a waiting call that no holder has taken yet.
  bool listed(int i, std::memory_order order) const {
    return slots_[i].call.state.load(order) == combiner_call::waiting && !taken_[i].load(std::memory_order_relaxed);
  }
  void raise_hint() {
    if (!maybe_listed_.load(std::memory_order_seq_cst)) maybe_listed_.store(true, std::memory_order_seq_cst);
  }

  // A cache line each: a caller writes its slot while the holder works.
  struct alignas(64) slot {
    Call call;
  };
  std::unique_ptr<slot[]> slots_;
  // Written by the lock's holder only, apart from the callers' lines.
  std::unique_ptr<std::atomic<bool>[]> taken_;
  // Its own cache line: callers read it on every listing.
  alignas(64) std::atomic<bool> maybe_listed_{false};
};

}  // namespace streamalloc
