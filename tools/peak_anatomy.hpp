// Where reserved memory stood when it peaked: replays a trace up to the
// allocation that set the reserved peak and splits the reserved bytes just
// before it into what lives there and what sits free, and of the free
// bytes, what stitching could move (idle chunks) and what it cannot (free
// bytes in chunks that also hold a block in use, free bytes of plain
// segments), and lists the mapped runs just after it. It says why a
// replay's ratio is above 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "streamalloc/core/caching_allocator.hpp"
#include "trace_reader.hpp"

namespace streamalloc {

// A contiguous mapped run of an expandable segment (default pool), just
// after the allocation that set the peak: bytes = in use + idle + partly
// used free.
struct peak_run {
  std::size_t bytes = 0;
  bool small = false;  // the small pool's run
  std::size_t blocks_in_use = 0;  // allocated, or freed and waiting for stream events
  std::size_t bytes_in_use = 0;
  std::size_t idle_chunk_bytes = 0;
  std::size_t partly_used_free_bytes = 0;
};

struct peak_anatomy {
  bool found = false;  // false: the trace reserved nothing
  // The allocation that set the reserved peak: its index among the trace's
  // allocate/free calls (as in --timeline), its line, size and stream.
  std::uint64_t op = 0;
  std::uint64_t line = 0;
  // The allocation was made before recording began (its line is its free's).
  bool before_recording = false;
  std::size_t request_bytes = 0;
  std::uint64_t stream = 0;
  std::size_t reserved_after = 0;  // the peak

  // Just before that allocation, reserved_before = requested + rounding +
  // pending_free + idle_chunk + partly_used_free + plain_free.
  std::size_t reserved_before = 0;
  std::size_t requested_bytes = 0;  // what live allocations asked for
  std::size_t rounding_bytes = 0;   // their blocks beyond that
  std::size_t pending_free_bytes = 0;  // freed, waiting for stream events
  // Expandable segments: free chunks with no block in use, and free bytes in
  // chunks that also hold one.
  std::size_t idle_chunk_bytes = 0;
  std::size_t partly_used_free_bytes = 0;
  std::size_t plain_free_bytes = 0;  // free blocks of plain segments
  std::size_t mapped_runs = 0;       // contiguous mapped runs of expandable segments
  // Just after that allocation: every mapped run, those with the most free
  // bytes in partly used chunks first (where the excess over live bytes
  // lies when no idle chunk is left).
  std::vector<peak_run> runs_after;
  // What the allocation itself did, from the statistics' counters around
  // it: chunks it mapped, how many of those it first unmapped from idle
  // chunks elsewhere (stitching) and the stream syncs that took, and the
  // device allocations and frees it made. Growth while idle chunks sat
  // cached shows here: the idle chunks left just after it (the runs'
  // idle_chunk_bytes, idle_chunk_bytes_after) are those stitching did not
  // take.
  std::size_t call_chunk_maps = 0;
  std::size_t call_chunk_unmaps = 0;
  std::size_t call_stitch_syncs = 0;
  std::size_t call_device_allocs = 0;
  std::size_t call_device_frees = 0;
  // The second replay reached the same peak at the same allocation (false
  // would mean the replay is not repeatable, and the figures describe
  // another layout).
  bool repeated = false;
};

// The idle chunk bytes of the mapped runs just after the peak allocation.
std::size_t idle_chunk_bytes_after(const peak_anatomy& a);

// `make_allocator` returns a fresh allocator each call (two replays; the
// device may be the same, with the previous allocator gone). Throws what
// the replays throw.
peak_anatomy examine_reserved_peak(const std::vector<trace_file_event>& events,
                                   const std::function<std::unique_ptr<caching_allocator>()>& make_allocator);

}  // namespace streamalloc
