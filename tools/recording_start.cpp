#include "recording_start.hpp"

#include <unordered_set>

namespace streamalloc {

allocations_before_recording add_allocations_before_recording(std::vector<trace_file_event>* events) {
  allocations_before_recording added;
  std::vector<trace_file_event> earlier;
  std::unordered_set<std::uint64_t> seen;  // addresses an alloc or free_completed named
  for (const trace_file_event& e : *events) {
    if (e.action == trace_file_action::alloc) {
      seen.insert(e.addr);
    } else if (e.action == trace_file_action::free_completed && seen.insert(e.addr).second) {
      trace_file_event alloc = e;
      alloc.action = trace_file_action::alloc;
      alloc.before_recording = true;
      earlier.push_back(alloc);
      ++added.blocks;
      added.bytes += e.size;
    }
  }
  if (!earlier.empty()) events->insert(events->begin(), earlier.begin(), earlier.end());
  return added;
}

}  // namespace streamalloc
