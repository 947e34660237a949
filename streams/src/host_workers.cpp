// host_workers: the worker threads behind parallel memcpys. Every worker
// joins every loop and takes task indices from a shared counter, so a loop
// ends when all workers have reported back and the task function (owned by
// the caller's stack frame) is no longer referenced.
#include "streamalloc/streams/host_workers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace streamalloc {
namespace {

constexpr std::size_t k_stripe_alignment_bytes = 4096;

}  // namespace

host_workers::host_workers(int parallelism) : owner_pid_(static_cast<int>(getpid())) {
  const int helpers = std::max(parallelism, 1) - 1;
  threads_.reserve(static_cast<std::size_t>(helpers));
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { worker_main(); });
}

host_workers::~host_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void host_workers::worker_main() {
  std::uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    while (next_task_ < task_count_) {
      const int index = next_task_++;
      lock.unlock();
      (*task_)(index);
      lock.lock();
    }
    if (++workers_done_ == static_cast<int>(threads_.size())) finished_.notify_one();
  }
}

void host_workers::run(int tasks, const std::function<void(int)>& task) {
  if (tasks <= 0) return;
  if (tasks == 1 || threads_.empty() || static_cast<int>(getpid()) != owner_pid_) {
    for (int i = 0; i < tasks; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> turn(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = &task;
  task_count_ = tasks;
  next_task_ = 0;
  workers_done_ = 0;
  ++generation_;
  wake_.notify_all();
  while (next_task_ < task_count_) {
    const int index = next_task_++;
    lock.unlock();
    task(index);
    lock.lock();
  }
  finished_.wait(lock, [&] { return workers_done_ == static_cast<int>(threads_.size()); });
  task_ = nullptr;
}

void host_workers::copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  const std::size_t by_size = std::max<std::size_t>(bytes / k_min_stripe_bytes, 1);
  const std::size_t stripes = std::min<std::size_t>(by_size, static_cast<std::size_t>(parallelism()));
  if (stripes == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Stripe boundaries on page multiples keep two threads off one page.
  std::size_t stripe = (bytes + stripes - 1) / stripes;
  stripe = (stripe + k_stripe_alignment_bytes - 1) / k_stripe_alignment_bytes * k_stripe_alignment_bytes;
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  run(static_cast<int>(stripes), [&](int i) {
    const std::size_t begin = static_cast<std::size_t>(i) * stripe;
    if (begin >= bytes) return;
    std::memcpy(out + begin, in + begin, std::min(stripe, bytes - begin));
  });
}

int default_copy_parallelism() {
  const unsigned hardware = std::thread::hardware_concurrency();
  return std::clamp(static_cast<int>(hardware / 2), 1, 8);
}

}  // namespace streamalloc
