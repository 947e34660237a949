// Traces recorded mid-run. torch's memory history records from the moment
// _record_memory_history is called (or keeps only its last max_entries
// events), so a trace may free blocks allocated before it began: a model
// loaded first, activations of the step in progress. Replay treats such a
// block as allocated before the trace's first event, the way torch's
// memory_viz draws blocks it sees freed but never allocated.
#pragma once

#include <cstdint>
#include <vector>

#include "trace_reader.hpp"

namespace streamalloc {

struct allocations_before_recording {
  std::uint64_t blocks = 0;
  std::uint64_t bytes = 0;
};

// For each free_completed whose address no earlier alloc or free_completed
// of the trace names, puts an alloc event of the free's size, stream and
// line at the front of `events` (in the order of those frees) with
// before_recording set. A second free of an address stays as it is, for
// replay to reject. Returns what was added.
allocations_before_recording add_allocations_before_recording(std::vector<trace_file_event>* events);

}  // namespace streamalloc
