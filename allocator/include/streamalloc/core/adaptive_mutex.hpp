// adaptive_mutex: the per-device allocator lock. Critical sections are a few
// hundred nanoseconds, far shorter than a sleep/wake through the kernel, so
// a contended lock first spins briefly (glibc's adaptive mutex) before it
// blocks. Satisfies Lockable, so std::lock_guard works with it.
#pragma once

#include <pthread.h>

namespace streamalloc {

class adaptive_mutex {
 public:
  adaptive_mutex() {
    pthread_mutexattr_t attributes;
    pthread_mutexattr_init(&attributes);
#if defined(PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP)
    pthread_mutexattr_settype(&attributes, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    pthread_mutex_init(&mutex_, &attributes);
    pthread_mutexattr_destroy(&attributes);
  }
  ~adaptive_mutex() { pthread_mutex_destroy(&mutex_); }
  adaptive_mutex(const adaptive_mutex&) = delete;
  adaptive_mutex& operator=(const adaptive_mutex&) = delete;

  void lock() { pthread_mutex_lock(&mutex_); }
  bool try_lock() { return pthread_mutex_trylock(&mutex_) == 0; }
  void unlock() { pthread_mutex_unlock(&mutex_); }

 private:
  pthread_mutex_t mutex_;
};

}  // namespace streamalloc
