// The process-wide allocator set. It is allocated with `new` and never
// deleted: torch frees tensors from static destructors and at interpreter
// exit, after this file's statics would otherwise be gone, and those frees
// must still find a live allocator.
#include "process_allocator.hpp"

#include <atomic>
#include <mutex>
#include <optional>
#include <utility>

#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

struct process_state {
  std::mutex mutex;  // guards creation and `config`
  std::optional<allocator_config> config;
  // Set once, after the allocators are fully built; read without the lock.
  std::atomic<device_allocators*> allocators{nullptr};
};

process_state& state() {
  static process_state* const instance = new process_state;
  return *instance;
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

device_allocators* find_process_allocators() { return state().allocators.load(std::memory_order_acquire); }

bool process_allocators_created() { return find_process_allocators() != nullptr; }

device_allocators& process_allocators() {
  if (device_allocators* existing = find_process_allocators()) return *existing;
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
