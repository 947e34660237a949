// Trace events: what the allocator did, in the vocabulary of torch's memory
// history (torch.cuda.memory._record_memory_history). The core collects them
// while a trace_listener is set and hands them over after its lock is
// released, on the thread whose call produced them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/snapshot.hpp"

namespace streamalloc {

enum class trace_action {
  alloc,           // a block handed to the caller
  free_requested,  // the caller freed a block (it may still be pending)
  free_completed,  // the block's memory is reusable (its stream uses ended)
  segment_alloc,   // a plain segment obtained from the device (or a pool's source)
  segment_free,    // a plain segment returned
  segment_map,     // chunks mapped into an expandable segment
  segment_unmap,   // chunks unmapped from an expandable segment
  oom              // the allocator raised out_of_memory
};
// torch's spelling: "alloc", "free_requested", ..., "oom".
const char* to_string(trace_action action);

struct trace_event {
  trace_action action = trace_action::alloc;
  // The block or range address; for oom, the device's free bytes (torch's
  // convention).
  std::uintptr_t address = 0;
  // Block or range bytes; for oom, the bytes requested.
  std::size_t size = 0;
  stream_handle stream = 0;
  pool_id pool = 0;
};

class trace_listener {
 public:
  virtual ~trace_listener() = default;
  // Receives the events of one allocator call, in the order they happened.
  // Runs without the allocator's lock held; it may call the allocator. It
  // must not throw: an exception it throws is dropped.
  virtual void on_trace(const trace_event* events, std::size_t count) = 0;
};

}  // namespace streamalloc
