// The process-wide allocator set. It is allocated with `new` and never
// deleted: torch frees tensors from static destructors and at interpreter
// exit, after this file's statics would otherwise be gone, and those frees
// must still find a live allocator. Note [fork] explains the fork handlers.
#include "process_allocator.hpp"

#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

// Note [fork]
// DataLoader workers (and any os.fork) copy the process with only the
// forking thread. An allocator lock held by another thread at that moment
// would stay locked forever in the child, so the prepare handler takes the
// creation lock and every created allocator's lock before the fork, and
// both sides release them after it. A child forked after CUDA was in use
// cannot use CUDA at all: it is marked, every lookup there finds no
// allocator, allocations fail with k_forked_child_message, and frees of
// the parent's blocks are no-ops that never reach the driver.
constexpr const char* k_forked_child_message =
    "streamalloc: CUDA cannot be used in a forked child process; use the 'spawn' start method";

struct process_state {
  std::mutex mutex;  // guards creation and `config`
  std::optional<allocator_config> config;
  // Set once, after the allocators are fully built; read without the lock.
  std::atomic<device_allocators*> allocators{nullptr};
  // The allocators the prepare handler locked, in locking order.
  std::vector<device_allocator*> locked_for_fork;
  std::atomic<bool> forked_child{false};
};

void prepare_fork();
void after_fork_in_parent();
void after_fork_in_child();

process_state& state() {
  static process_state* const instance = [] {
    auto* created = new process_state;
    created->locked_for_fork.reserve(64);
    if (pthread_atfork(prepare_fork, after_fork_in_parent, after_fork_in_child) != 0) {
      std::fputs("streamalloc: pthread_atfork failed; forking while allocating may deadlock the child\n", stderr);
    }
    return created;
  }();
  return *instance;
}

void prepare_fork() {
  process_state& s = state();
  s.mutex.lock();
  s.locked_for_fork.clear();
  if (device_allocators* all = s.allocators.load(std::memory_order_acquire)) {
    for (int d = 0; d < all->device_count(); ++d) {
      if (device_allocator* allocator = all->find(d)) {
        allocator->lock_for_fork();
        s.locked_for_fork.push_back(allocator);
      }
    }
  }
}

void unlock_after_fork(process_state& s) {
  for (auto it = s.locked_for_fork.rbegin(); it != s.locked_for_fork.rend(); ++it) (*it)->unlock_after_fork();
  s.locked_for_fork.clear();
  s.mutex.unlock();
}

void after_fork_in_parent() { unlock_after_fork(state()); }

void after_fork_in_child() {
  process_state& s = state();
  if (s.allocators.load(std::memory_order_relaxed) != nullptr) s.forked_child.store(true, std::memory_order_relaxed);
  unlock_after_fork(s);
}

allocator_config pending_config_locked(const process_state& s) {
  return s.config ? *s.config : allocator_config::from_environment();
}

void require_not_created_locked(const process_state& s) {
  if (s.allocators.load(std::memory_order_relaxed) != nullptr) {
    throw usage_error("streamalloc: the allocator is already in use; configure it before the first CUDA allocation");
  }
}

}  // namespace

device_allocators* find_process_allocators() {
  process_state& s = state();
  if (s.forked_child.load(std::memory_order_relaxed)) return nullptr;
  return s.allocators.load(std::memory_order_acquire);
}

bool in_forked_child() { return state().forked_child.load(std::memory_order_relaxed); }

bool process_allocators_created() { return find_process_allocators() != nullptr; }

device_allocators& process_allocators() {
  if (device_allocators* existing = find_process_allocators()) return *existing;
  if (in_forked_child()) throw device_failure(k_forked_child_message);
  process_state& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (device_allocators* existing = s.allocators.load(std::memory_order_relaxed)) return *existing;
  allocator_config config = pending_config_locked(s);
  status error;
  const int count = cuda_device_count(&error);
  if (count == 0) throw device_failure("streamalloc: cannot create the CUDA allocator: " + error.message());
  auto* created = new device_allocators(count, make_cuda_backend, std::move(config));
  s.allocators.store(created, std::memory_order_release);
  return *created;
}

void configure_process_allocators(const allocator_config& config) {
  process_state& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  require_not_created_locked(s);
  s.config = config;
}

void configure_process_allocators(const std::string& overrides) {
  process_state& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  require_not_created_locked(s);
  s.config = pending_config_locked(s).with(overrides);
}

allocator_config process_allocator_config() {
  if (device_allocators* existing = find_process_allocators()) return existing->config();
  process_state& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (device_allocators* existing = s.allocators.load(std::memory_order_relaxed)) return existing->config();
  return pending_config_locked(s);
}

}  // namespace streamalloc
