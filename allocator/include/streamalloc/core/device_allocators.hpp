// device_allocators: one device_allocator per device, created on first use
// from a backend factory. This is the object behind the process-wide
// allocator that torch and the extern "C" entry points use.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/config.hpp"

namespace streamalloc {

class device_allocators {
 public:
  // Makes the backend for a device index; returns nullptr plus a status
  // message when the device does not exist or cannot be used.
  using backend_factory = std::function<std::unique_ptr<device_backend>(int device, status* error)>;

  device_allocators(int device_count, backend_factory factory, allocator_config config);
  ~device_allocators();

  int device_count() const { return static_cast<int>(slots_.size()); }
  // The allocator of `device`, created on first use. Throws usage_error for
  // an index outside [0, device_count) and device_failure if the backend
  // cannot be made.
  device_allocator& at(int device);
  // The allocator of `device` if it was already created, else nullptr.
  device_allocator* find(int device) const;
  // Runs `hook` for every allocator created so far and, from now on, for
  // each one right after it is created (before first use). One hook; a
  // second call replaces it.
  using creation_hook = std::function<void(int device, device_allocator& allocator)>;
  void set_creation_hook(creation_hook hook);
  // The settings allocators are created with (a copy: update_config may
  // change them).
  allocator_config config() const;
  // torch.cuda.memory._set_allocator_settings: applies the run-time keys
  // (device_allocator::update_config) to every allocator already created
  // and to those created later. All or nothing: usage_error or
  // config_error leaves every allocator as it was.
  void update_config(const allocator_config& config);

 private:
  struct slot {
    std::unique_ptr<device_backend> backend;
    std::unique_ptr<device_allocator> allocator;
    std::atomic<device_allocator*> published{nullptr};  // read without config_mutex_
  };
  backend_factory factory_;
  // Guards config_, and is held while an allocator is created and
  // published, so update_config reaches every allocator exactly once.
  mutable std::mutex config_mutex_;
  allocator_config config_;
  std::mutex hook_mutex_;
  creation_hook hook_;
  std::vector<std::unique_ptr<slot>> slots_;
};

}  // namespace streamalloc
