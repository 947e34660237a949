// Replays an allocation trace through a caching_allocator and measures what
// it reserved, next to what PyTorch's native allocator reserved for the same
// program (read from the trace's own segment_* events).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/errors.hpp"
#include "trace_reader.hpp"

namespace streamalloc {

struct replay_result {
  std::uint64_t events = 0;  // every event of the trace, ignored ones included
  std::uint64_t allocs = 0;  // allocate calls
  std::uint64_t frees = 0;   // free calls (size-0 allocations get nullptr and no free)
  std::uint64_t ops = 0;     // allocs + frees: the calls that were timed
  // Allocations the trace never frees; replay frees them after timing.
  std::uint64_t live_at_end = 0;
  // Of allocs, those made before recording began (add_allocations_before_recording).
  std::uint64_t allocs_before_recording = 0;
  std::uint64_t bytes_before_recording = 0;

  // Peak of the sum of live requested sizes, computed from the trace alone.
  std::size_t trace_peak_live_bytes = 0;
  // The allocator's own figures: requested_bytes.all.peak (equals the trace's
  // peak live bytes when its accounting is right) and reserved_bytes.all.peak.
  std::size_t peak_allocated_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  double frag_ratio = 0.0;    // peak reserved / peak allocated (0 when nothing was allocated)
  std::int64_t segments = 0;  // device allocations the allocator made (num_device_alloc)
  // Expandable segments: chunk map/unmap calls, allocations served by
  // stitched chunks, stream synchronizations stitching waited for.
  std::int64_t chunk_maps = 0;
  std::int64_t chunk_unmaps = 0;
  std::int64_t stitched_blocks = 0;
  std::int64_t stitch_syncs = 0;
  // Free blocks handed from one stream to another (Note [cross-stream reuse]).
  std::int64_t cross_stream_reuses = 0;

  // Wall time of the allocate/free loop, parsing excluded.
  std::uint64_t total_ns = 0;
  double ns_per_op = 0.0;

  // PyTorch's native allocator as recorded: segment_alloc/segment_map add
  // their size to reserved memory, segment_free/segment_unmap subtract it.
  bool native_recorded = false;       // any segment event: native's figures are known
  std::uint64_t native_segments = 0;  // segment_alloc + segment_map events
  std::uint64_t native_segment_allocs = 0;  // segment_alloc events: one cudaMalloc each
  std::uint64_t native_segment_maps = 0;    // segment_map events: one mapped run of pages each (expandable)
  std::size_t native_peak_reserved_bytes = 0;
  // Of native_peak_reserved_bytes, what the trace shows was reserved before
  // recording began, at least: 0 for a trace recorded from the start.
  std::size_t native_reserved_before_recording_bytes = 0;
  double native_frag_ratio = 0.0;  // native peak reserved / trace peak live bytes

  // Lines of actions the trace format does not name, skipped by the reader
  // (trace_reader::skipped_actions); filled by the caller that read the file.
  std::vector<skipped_action> skipped_actions;
  // free_requested events replayed as frees, in a trace without
  // free_completed (free_at_requests_without_completions); filled likewise.
  std::uint64_t frees_at_requests = 0;
};

// The allocator could not serve one of the trace's alloc events.
class replay_out_of_memory : public std::runtime_error {
 public:
  replay_out_of_memory(const std::string& path, std::uint64_t line, std::uint64_t bytes, const out_of_memory& cause);
  const oom_context& context() const noexcept { return context_; }
  std::uint64_t line() const noexcept { return line_; }

 private:
  oom_context context_;
  std::uint64_t line_;
};

// Trace streams on the simulated device: every nonzero stream handle of the
// trace (a CUDA stream pointer in the recorded program) becomes a stream of
// `device` (sim_backend::new_stream), 0 stays the default stream. Without
// it the device would refuse events on those streams, and the replay would
// lose cross-stream reuse and stitching from other streams' blocks.
void remap_streams_to_sim(std::vector<trace_file_event>& events, sim_backend& device);

// Replays `events` (read from `path`, named in errors) through `allocator`,
// which should be fresh: its peak counters are reset first and its stats
// are the measurement. `alloc` -> allocate(size, stream) with the event's
// stream value as the stream handle (remapped to the device's streams
// first: remap_streams_to_sim, or created CUDA streams on a GPU);
// `free_completed` -> free; everything else is not replayed. Throws
// trace_error for a free of an address that is not live (a trace recorded
// mid-run goes through add_allocations_before_recording first), an alloc
// at an address that already is, or a trace with nothing to measure (no
// alloc of more than 0 bytes), all before any allocator call;
// replay_out_of_memory when the allocator runs out. Every allocation made is
// freed again before returning or throwing.
replay_result replay_trace(const std::vector<trace_file_event>& events, caching_allocator& allocator,
                           const std::string& path);

}  // namespace streamalloc
