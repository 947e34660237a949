// Event pool: reuse of device events so frees never create one on the hot
// path. Events are destroyed only when the pool (its allocator) goes away.
#include "streamalloc/core/event_pool.hpp"

namespace streamalloc {

event_pool::~event_pool() {
  for (event_handle event : free_) backend_.destroy_event(event);
}

status event_pool::acquire(event_handle* out) {
  if (!free_.empty()) {
    *out = free_.back();
    free_.pop_back();
    return status::success();
  }
  return backend_.create_event(out);
}

}  // namespace streamalloc
