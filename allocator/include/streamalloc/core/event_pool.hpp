// event_pool: device events created once and reused, so the hot path never
// creates or destroys an event. Not thread-safe: its owner locks.
#pragma once

#include <vector>

#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {

class event_pool {
 public:
  explicit event_pool(device_backend& backend) : backend_(backend) {}
  ~event_pool();
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;

  // An unrecorded-or-reusable event; a failed creation returns the status.
  status acquire(event_handle* out);
  void release(event_handle event) { free_.push_back(event); }
  std::size_t cached() const { return free_.size(); }

 private:
  device_backend& backend_;
  std::vector<event_handle> free_;
};

}  // namespace streamalloc
