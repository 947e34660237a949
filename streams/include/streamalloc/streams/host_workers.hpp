// host_workers: a fixed set of threads that run one parallel loop at a time.
// The staged copy engine and pinned copies use it to spread large memcpys
// over several cores, since one core cannot keep up with a PCIe 5 DMA.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace streamalloc {

class host_workers {
 public:
  // `parallelism` counts the calling thread: 1 runs everything inline.
  explicit host_workers(int parallelism);
  ~host_workers();
  host_workers(const host_workers&) = delete;
  host_workers& operator=(const host_workers&) = delete;

  int parallelism() const { return static_cast<int>(threads_.size()) + 1; }

  // Calls task(0) .. task(tasks - 1) on the workers and the calling thread
  // and returns when all have finished. `task` must not throw. Concurrent
  // callers take turns. In a child forked from the owning process, whose
  // worker threads did not survive the fork, everything runs inline.
  void run(int tasks, const std::function<void(int)>& task);

  // memcpy split into page-aligned stripes of at least k_min_stripe_bytes.
  void copy(void* dst, const void* src, std::size_t bytes);

  // Below this, waking another thread costs more than the copy it saves.
  static constexpr std::size_t k_min_stripe_bytes = std::size_t{256} << 10;

 private:
  void worker_main();

  std::mutex run_mutex_;  // one loop at a time
  std::mutex mutex_;      // guards the loop state below
  std::condition_variable wake_;
  std::condition_variable finished_;
  const std::function<void(int)>* task_ = nullptr;
  int task_count_ = 0;
  int next_task_ = 0;
  std::uint64_t generation_ = 0;
  int workers_done_ = 0;
  bool stopping_ = false;
  const int owner_pid_;
  std::vector<std::thread> threads_;
};

// A default copy parallelism for this machine: half its hardware threads,
// between 1 and 8 (more rarely helps memcpy bandwidth and steals cores
// from data-loading workers).
int default_copy_parallelism();

}  // namespace streamalloc
