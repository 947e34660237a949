// call_combiner: the calls waiting for the allocator's lock, in a lock-free
// list that the lock's holder empties (Note [combined calls] in
// caching_allocator.cpp). A caller that finds the lock taken adds its call
// and waits on the call's state; the holder runs the listed calls before it
// unlocks and marks each one finished, so the allocator's state stays in
// the holder's cache instead of moving to every caller's core in turn.
#pragma once

#include <atomic>

namespace streamalloc {

class call_combiner {
 public:
  // A waiting call, on its caller's stack; the caller's own type adds what
  // the call is. The holder must not touch it once it is finished.
  struct call {
    enum state_type : int {
      waiting = 0,
      done,      // the holder ran it
      declined,  // the holder left it to its caller, who must take the lock
    };
    call* next = nullptr;
    std::atomic<int> state{waiting};

    void finish(state_type how) { state.store(how, std::memory_order_release); }
    int poll() const { return state.load(std::memory_order_acquire); }
  };

  call_combiner() = default;
  call_combiner(const call_combiner&) = delete;
  call_combiner& operator=(const call_combiner&) = delete;

  void add(call* c) {
    call* head = head_.load(std::memory_order_relaxed);
    do {
      c->next = head;
    } while (!head_.compare_exchange_weak(head, c, std::memory_order_release, std::memory_order_relaxed));
  }

  // Takes every listed call, oldest first (nullptr: none).
  call* take_all() {
    if (head_.load(std::memory_order_relaxed) == nullptr) return nullptr;
    call* newest_first = head_.exchange(nullptr, std::memory_order_acquire);
    call* oldest_first = nullptr;
    while (newest_first != nullptr) {
      call* next = newest_first->next;
      newest_first->next = oldest_first;
      oldest_first = newest_first;
      newest_first = next;
    }
    return oldest_first;
  }

  bool empty() const { return head_.load(std::memory_order_relaxed) == nullptr; }

  // Forgets the listed calls without running them: in a forked child,
  // whose only thread is the one that forked, their callers do not exist.
  void forget_all() { head_.store(nullptr, std::memory_order_relaxed); }

 private:
  // Its own cache line: callers write it while the holder works elsewhere.
  alignas(64) std::atomic<call*> head_{nullptr};
};

}  // namespace streamalloc
