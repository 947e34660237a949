// The threads' slot indices of call_combiner. Lock-free, so a process that
// forks while another thread takes or gives back an index leaves nothing
// locked in the child.
#include "streamalloc/core/call_combiner.hpp"

namespace streamalloc {
namespace {

std::atomic<bool> g_taken[k_combiner_slots];
std::atomic<int> g_in_use{0};

constexpr int k_no_slot_yet = -1;
constexpr int k_exiting = -2;
thread_local int t_slot = k_no_slot_yet;

// Gives the slot back when its thread exits. A free during a later
// thread-exit destructor finds the thread exiting and queues on the lock.
struct slot_release {
  bool armed = false;
  ~slot_release() {
    if (armed && t_slot >= 0) g_taken[t_slot].store(false, std::memory_order_release);
    t_slot = k_exiting;
  }
};
thread_local slot_release t_release;

void raise_in_use(int count) {
  int seen = g_in_use.load(std::memory_order_relaxed);
  while (seen < count && !g_in_use.compare_exchange_weak(seen, count, std::memory_order_release)) {
  }
}

}  // namespace

int combiner_thread_slot() {
  if (t_slot >= 0) return t_slot;
  if (t_slot == k_exiting) return -1;
  for (int i = 0; i < k_combiner_slots; ++i) {
    bool expected = false;
    if (!g_taken[i].load(std::memory_order_relaxed) &&
        g_taken[i].compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      t_release.armed = true;  // constructs it, so the thread's exit runs its destructor
      t_slot = i;
      raise_in_use(i + 1);
      return i;
    }
  }
  return -1;
}

int combiner_slots_in_use() { return g_in_use.load(std::memory_order_acquire); }

}  // namespace streamalloc
