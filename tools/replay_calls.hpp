// The untimed replay loop the replay tool's extra passes share (--timeline,
// --peak-anatomy): allocate at each alloc event, free at each
// free_completed, with hooks around the calls. replay_trace keeps its own
// loop, which is the one timed.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "streamalloc/core/caching_allocator.hpp"
#include "trace_reader.hpp"

namespace streamalloc {

// Makes the allocate and free calls of `events` on `allocator` in order,
// numbering them from 0 as --timeline does. `before_alloc(op, event)` runs
// before each allocation and ends the replay when it returns false;
// `after_call(op)` runs after each call. What is still live at the end is
// freed, also when a call throws. A free of an address that is not live is
// skipped (replay_trace reports such a trace).
template <typename before_alloc_fn, typename after_call_fn>
void replay_calls(const std::vector<trace_file_event>& events, caching_allocator& allocator,
                  before_alloc_fn&& before_alloc, after_call_fn&& after_call) {
  std::unordered_map<std::uint64_t, void*> live;  // trace address -> allocator pointer
  const auto free_all = [&] {
    for (const auto& entry : live) {
      if (entry.second != nullptr) allocator.free(entry.second);
    }
    live.clear();
  };
  std::uint64_t op = 0;
  try {
    for (const trace_file_event& e : events) {
      if (e.action == trace_file_action::alloc) {
        if (!before_alloc(op, e)) break;
        live.emplace(e.addr, allocator.allocate(e.size, static_cast<stream_handle>(e.stream)));
        after_call(op++);
      } else if (e.action == trace_file_action::free_completed) {
        const auto it = live.find(e.addr);
        if (it == live.end()) continue;
        void* ptr = it->second;
        live.erase(it);
        if (ptr != nullptr) allocator.free(ptr);
        after_call(op++);
      }
    }
  } catch (...) {
    free_all();
    throw;
  }
  free_all();
}

}  // namespace streamalloc
