// Trace events of the caching allocator: torch's spellings of the actions,
// the listener registration, and the hand-over of each call's events to the
// listener once the call has released the allocator's lock.
//
// Note [trace delivery]: while a listener is set, the core appends events to
// trace_events_ under its lock (record_trace_locked: one branch when no
// listener is set, and nothing to allocate). Every public call that can
// produce events holds the lock through a locked_call (which runs no
// other thread's call while a listener is set, Note [combined calls]),
// whose destructor takes the buffer, releases the lock and only then calls
// the listener, on the calling thread and before the call returns -- or
// before its exception (out_of_memory after an oom event) reaches the
// caller. So the listener may call back into the allocator, and each call's events arrive in the
// order they happened; calls made on one thread arrive in call order.
// Concurrent calls on different threads each deliver their own batch, so
// their batches may reach the listener in either order.
//
// Because delivery runs outside the lock, set_trace_listener cannot simply
// swap the pointer: a thread may have taken the old listener and not yet
// called it. Each delivery is registered (delivering_) before the lock is
// released, and set_trace_listener waits until none is left for the
// listener it replaced, except deliveries running on its own thread (a
// listener that unregisters itself from on_trace must not wait for itself).
#include <algorithm>
#include <utility>
#include <vector>

#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/trace.hpp"

namespace streamalloc {
namespace {

struct delivery {
  const caching_allocator* allocator;
  const trace_listener* listener;
};

// The deliveries the current thread is inside of (nested when a listener
// calls back into an allocator).
thread_local std::vector<delivery> t_deliveries;

}  // namespace

const char* to_string(trace_action action) {
  switch (action) {
    case trace_action::alloc:
      return "alloc";
    case trace_action::free_requested:
      return "free_requested";
    case trace_action::free_completed:
      return "free_completed";
    case trace_action::segment_alloc:
      return "segment_alloc";
    case trace_action::segment_free:
      return "segment_free";
    case trace_action::segment_map:
      return "segment_map";
    case trace_action::segment_unmap:
      return "segment_unmap";
    case trace_action::oom:
      return "oom";
  }
  return "unknown";
}

void caching_allocator::set_trace_listener(trace_listener* listener) {
  trace_listener* replaced = nullptr;
  {
    std::lock_guard<adaptive_mutex> lock(mutex_);
    replaced = listener_;
    listener_ = listener;
  }
  if (replaced == nullptr || replaced == listener) return;
  const auto own = std::count_if(t_deliveries.begin(), t_deliveries.end(), [&](const delivery& d) {
    return d.allocator == this && d.listener == replaced;
  });
  std::unique_lock<std::mutex> guard(delivery_mutex_);
  delivery_done_.wait(guard, [&] { return std::count(delivering_.begin(), delivering_.end(), replaced) <= own; });
}

void caching_allocator::deliver_trace_and_unlock() {
  std::vector<trace_event> events;
  events.swap(trace_events_);
  trace_listener* const listener = listener_;
  bool registered = false;
  if (listener != nullptr) {
    try {
      std::lock_guard<std::mutex> guard(delivery_mutex_);
      delivering_.push_back(listener);
      registered = true;
    } catch (...) {
      // No memory for the bookkeeping: the events are dropped rather than
      // delivered where set_trace_listener could not wait for them.
    }
  }
  mutex_.unlock();
  if (!registered) return;

  bool tracked = false;
  try {
    t_deliveries.push_back({this, listener});
    tracked = true;
    // The destructor calling this may run during unwinding, where no
    // exception may escape: the listener is told not to throw (trace.hpp).
    listener->on_trace(events.data(), events.size());
  } catch (...) {
  }
  if (tracked) t_deliveries.pop_back();
  {
    std::lock_guard<std::mutex> guard(delivery_mutex_);
    delivering_.erase(std::find(delivering_.begin(), delivering_.end(), listener));
  }
  delivery_done_.notify_all();
}

}  // namespace streamalloc
