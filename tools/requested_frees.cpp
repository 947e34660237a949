#include "requested_frees.hpp"

#include <algorithm>

namespace streamalloc {

std::uint64_t free_at_requests_without_completions(std::vector<trace_file_event>* events) {
  const bool any_completed = std::any_of(events->begin(), events->end(), [](const trace_file_event& e) {
    return e.action == trace_file_action::free_completed;
  });
  if (any_completed) return 0;
  std::uint64_t converted = 0;
  for (trace_file_event& e : *events) {
    if (e.action != trace_file_action::free_requested) continue;
    e.action = trace_file_action::free_completed;
    ++converted;
  }
  return converted;
}

}  // namespace streamalloc
