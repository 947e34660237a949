// A sampling profiler for machines without perf (the lent H200 hosts):
// preloaded into a program, it gives every thread a timer that interrupts
// it each PC_SAMPLER_US microseconds of wall time (default 200) and records
// the program counter it stopped at; at exit it writes one line per
// address, "COUNT MODULE OFFSET SYMBOL", to PC_SAMPLER_OUT. CPU-time timers
// would fire only at the scheduler's ticks, hence wall time: a sleeping
// thread is sampled where it sleeps. scripts/pc-sampler/run.sh builds it,
// runs a command under it and sums the samples by function.
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>

namespace {

constexpr std::size_t k_capacity = std::size_t{1} << 22;
std::uintptr_t g_samples[k_capacity];
std::atomic<std::size_t> g_count{0};
long g_interval_us = 200;

void on_sample(int, siginfo_t*, void* context) {
  const auto* uc = static_cast<const ucontext_t*>(context);
  const std::size_t i = g_count.fetch_add(1, std::memory_order_relaxed);
  if (i < k_capacity) g_samples[i] = static_cast<std::uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
}

// Deleted when its thread exits: a timer outliving its thread would signal
// the process instead.
struct thread_timer {
  timer_t id{};
  bool armed = false;
  ~thread_timer() {
    if (armed) timer_delete(id);
  }
};
thread_local thread_timer t_timer;

void arm_thread_timer() {
  sigevent ev = {};
  ev.sigev_notify = SIGEV_THREAD_ID;
  ev.sigev_signo = SIGPROF;
  ev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
  if (timer_create(CLOCK_MONOTONIC, &ev, &t_timer.id) != 0) return;
  t_timer.armed = true;
  itimerspec period = {};
  period.it_interval.tv_sec = g_interval_us / 1000000;
  period.it_interval.tv_nsec = (g_interval_us % 1000000) * 1000;
  period.it_value = period.it_interval;
  timer_settime(t_timer.id, 0, &period, nullptr);
}

struct start_args {
  void* (*routine)(void*);
  void* arg;
};

void* start_sampled(void* p) {
  const start_args args = *static_cast<start_args*>(p);
  delete static_cast<start_args*>(p);
  arm_thread_timer();
  return args.routine(args.arg);
}

__attribute__((constructor)) void start() {
  if (const char* us = std::getenv("PC_SAMPLER_US")) g_interval_us = std::max(1L, std::atol(us));
  struct sigaction action = {};
  action.sa_sigaction = on_sample;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGPROF, &action, nullptr);
  arm_thread_timer();
}

__attribute__((destructor)) void stop() {
  signal(SIGPROF, SIG_IGN);
  const char* path = std::getenv("PC_SAMPLER_OUT");
  if (path == nullptr) return;
  std::map<std::uintptr_t, long> by_address;
  const std::size_t n = std::min(g_count.load(), k_capacity);
  for (std::size_t i = 0; i < n; ++i) ++by_address[g_samples[i]];
  std::FILE* out = std::fopen(path, "w");
  if (out == nullptr) return;
  for (const auto& [address, count] : by_address) {
    Dl_info info = {};
    if (dladdr(reinterpret_cast<void*>(address), &info) != 0 && info.dli_fname != nullptr) {
      std::fprintf(out, "%ld %s 0x%lx %s\n", count, info.dli_fname,
                   static_cast<unsigned long>(address - reinterpret_cast<std::uintptr_t>(info.dli_fbase)),
                   info.dli_sname != nullptr ? info.dli_sname : "-");
    } else {
      std::fprintf(out, "%ld ? 0x%lx -\n", count, static_cast<unsigned long>(address));
    }
  }
  std::fclose(out);
}

}  // namespace

// Every thread the program starts gets its timer first.
extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*routine)(void*), void* arg) {
  using create_fn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const auto real_create = reinterpret_cast<create_fn>(dlsym(RTLD_NEXT, "pthread_create"));
  return real_create(thread, attr, start_sampled, new start_args{routine, arg});
}
