// Traces without free_completed lines. torch records a free twice: when the
// program drops the block (free_requested) and when the block can be used
// again (free_completed, after the streams it was recorded on), and replay
// frees at the second. A trace whose writer kept only the first would
// replay with nothing ever freed, its peak the sum of every allocation;
// such a trace is replayed with each block freed at its request instead.
#pragma once

#include <cstdint>
#include <vector>

#include "trace_reader.hpp"

namespace streamalloc {

// When `events` hold free_requested events and no free_completed, turns
// every free_requested into a free_completed and returns how many; else
// changes nothing and returns 0.
std::uint64_t free_at_requests_without_completions(std::vector<trace_file_event>* events);

}  // namespace streamalloc
