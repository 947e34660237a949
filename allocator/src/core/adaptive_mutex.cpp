// adaptive_mutex's contended path: spin, then sleep on a futex.
#include "streamalloc/core/adaptive_mutex.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace streamalloc {
namespace {

// About as long as glibc's adaptive mutex spins before it sleeps: long
// enough to outlast a short critical section on another core.
constexpr int k_spins = 100;

void futex(std::atomic<int>* word, int op, int value) {
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "a futex word is an int");
  syscall(SYS_futex, reinterpret_cast<int*>(word), op | FUTEX_PRIVATE_FLAG, value, nullptr, nullptr, 0);
}

}  // namespace

void adaptive_mutex::lock_contended() {
  for (int i = 0; i < k_spins; ++i) {
    int expected = k_unlocked;
    if (state_.load(std::memory_order_relaxed) == k_unlocked &&
        state_.compare_exchange_weak(expected, k_locked, std::memory_order_acquire, std::memory_order_relaxed)) {
      return;
    }
    pause();
  }
  // Taken while marked contended: this thread cannot tell whether others
  // still sleep, so its unlock wakes one (at worst a spurious wake-up).
  while (state_.exchange(k_contended, std::memory_order_acquire) != k_unlocked) {
    futex(&state_, FUTEX_WAIT, k_contended);
  }
}

void adaptive_mutex::wake_one() { futex(&state_, FUTEX_WAKE, 1); }

}  // namespace streamalloc
