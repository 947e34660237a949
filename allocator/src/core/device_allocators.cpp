// Per-device allocator set: each device's backend and device_allocator are
// made on first use, so a process touching one GPU pays for one.
#include "streamalloc/core/device_allocators.hpp"

#include <string>
#include <utility>
#include <vector>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

device_allocators::device_allocators(int device_count, backend_factory factory, allocator_config config)
    : factory_(std::move(factory)), config_(std::move(config)) {
  for (int i = 0; i < device_count; ++i) slots_.push_back(std::make_unique<slot>());
}

device_allocators::~device_allocators() = default;

device_allocator& device_allocators::at(int device) {
  if (device < 0 || device >= device_count()) {
    throw usage_error("streamalloc: device index " + std::to_string(device) + " does not exist (" +
                      std::to_string(device_count()) + " device(s) visible)");
  }
  slot& s = *slots_[static_cast<std::size_t>(device)];
  if (device_allocator* ready = s.published.load(std::memory_order_acquire)) return *ready;
  // A failed creation leaves the slot empty, so a transient failure does
  // not poison it: the next call tries again. (Not std::call_once, whose
  // retry after a throw deadlocks under TSan's interceptors.)
  std::lock_guard<std::mutex> guard(config_mutex_);
  if (device_allocator* ready = s.published.load(std::memory_order_relaxed)) return *ready;
  status error;
  std::unique_ptr<device_backend> backend = factory_(device, &error);
  if (!backend) {
    throw device_failure("streamalloc: cannot use device " + std::to_string(device) + ": " + error.message());
  }
  auto allocator = std::make_unique<device_allocator>(*backend, config_);
  {
    // Under the hook's lock, so a concurrent set_creation_hook either
    // sees this allocator published or has its hook run here.
    std::lock_guard<std::mutex> lock(hook_mutex_);
    if (hook_) hook_(device, *allocator);
    s.backend = std::move(backend);
    s.allocator = std::move(allocator);
    s.published.store(s.allocator.get(), std::memory_order_release);
  }
  return *s.allocator;
}

void device_allocators::set_creation_hook(creation_hook hook) {
  std::lock_guard<std::mutex> lock(hook_mutex_);
  hook_ = std::move(hook);
  if (!hook_) return;
  for (int device = 0; device < device_count(); ++device) {
    if (device_allocator* existing = find(device)) hook_(device, *existing);
  }
}

allocator_config device_allocators::config() const {
  std::lock_guard<std::mutex> guard(config_mutex_);
  return config_;
}

void device_allocators::update_config(const allocator_config& config) {
  config.validate();
  std::lock_guard<std::mutex> guard(config_mutex_);
  config_.check_run_time_update(config);
  // Each allocator checks again (its device may refuse the chunk size);
  // one that refuses undoes the ones already changed.
  std::vector<std::pair<device_allocator*, allocator_config>> changed;
  try {
    for (int device = 0; device < device_count(); ++device) {
      device_allocator* allocator = find(device);
      if (allocator == nullptr) continue;
      allocator_config before = allocator->config();
      allocator->update_config(config);
      changed.emplace_back(allocator, std::move(before));
    }
  } catch (...) {
    for (auto& [allocator, before] : changed) allocator->update_config(before);
    throw;
  }
  config_ = config;
}

device_allocator* device_allocators::find(int device) const {
  if (device < 0 || device >= device_count()) return nullptr;
  return slots_[static_cast<std::size_t>(device)]->published.load(std::memory_order_acquire);
}

}  // namespace streamalloc
