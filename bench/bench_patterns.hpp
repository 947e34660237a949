// The allocation patterns streamalloc-bench times, and the summary of their
// repetitions. Every pattern counts "pairs": one allocate plus one free.
// The timed loops hold the allocator calls and a loop counter; anything a
// pattern needs to decide (sizes, which block to free) is computed before
// the clock starts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_allocator.hpp"

namespace streamalloc::bench {

// How much work a pattern does; slow allocators get it scaled down.
struct run_plan {
  int reps = 15;                       // timed repetitions
  int warmup_reps = 1;                 // untimed repetitions first (they also fill the caches)
  std::size_t pairs_per_rep = 20'000;  // same-size and cross-stream patterns
  std::size_t thread_pairs_per_rep = 10'000;  // per thread
  int slow_divisor = 100;              // iterations / this for slow allocators
  int slow_max_reps = 5;

  // The plan for `allocator`: fewer iterations when it is slow.
  run_plan for_allocator(const bench_allocator& allocator) const;
};

struct summary {
  double median = 0;
  double p10 = 0;
  double p90 = 0;
  double min = 0;
  double max = 0;
};
// "256 B", "64 KiB", "4 MiB": exact binary units as integers.
std::string size_label(std::size_t bytes);

// Median, 10th/90th percentile (nearest rank), min and max of `values`.
summary summarize(std::vector<double> values);

struct measurement {
  std::string pattern;  // same | mixed | threads | cross
  std::string label;    // the case within the pattern: "64 KiB", "16 threads"
  std::string allocator;
  std::size_t bytes = 0;  // same-size and cross-stream patterns
  int threads = 1;
  int reps = 0;
  std::uint64_t pairs_per_rep = 0;  // all threads together
  summary ns_per_pair;              // wall time of a repetition / its pairs
  std::vector<double> ns_per_pair_by_rep;  // the same, each timed repetition in order
  summary mpairs_per_s;             // pairs of a repetition / its wall time, in millions
  std::string error;                // set when the pattern failed; the figures are then empty
};

// One step of the mixed pattern: allocate `bytes` into `slot`, or free the
// block in `slot` when bytes == 0.
struct mixed_op {
  std::uint32_t bytes;
  std::uint32_t slot;
};

struct mixed_sequence {
  std::vector<mixed_op> ops;  // ends with every block freed
  std::uint32_t slots = 0;    // the most blocks live at once
  std::size_t pairs = 0;      // allocations (= frees)
  std::string description;    // sizes and live cap, for the report
};

// A seeded sequence of `steps` random steps with sizes log-uniform in
// [min_bytes, max_bytes] and at most `max_live` blocks live, a freed block
// chosen at random among the live ones, followed by frees of all blocks
// still live. Allocation is a little more likely than a free, so the live
// count climbs to `max_live` and then hovers below it.
mixed_sequence make_mixed_sequence(std::uint64_t seed, std::size_t steps, std::uint32_t max_live,
                                   std::size_t min_bytes, std::size_t max_bytes);
// The first `max_ops` operations of `sequence`, then frees of the blocks
// they leave live.
mixed_sequence truncate_mixed_sequence(const mixed_sequence& sequence, std::size_t max_ops);

// Same-size pairs: allocate(bytes) then free, repeated, on `stream`.
measurement run_same_size(bench_allocator& allocator, bench_device& device, bench_stream stream, std::size_t bytes,
                          const run_plan& plan);
// The mixed sequence, on `stream`; a slow allocator runs a prefix of it.
measurement run_mixed(bench_allocator& allocator, bench_device& device, bench_stream stream,
                      const mixed_sequence& sequence, const run_plan& plan);
// `streams.size()` threads start together, thread i runs `sequences[i]` on
// streams[i] (the same handle repeated when the threads share a stream).
// Throughput is all pairs of a repetition over the time from the first
// thread's start to the last thread's end.
measurement run_threads(bench_allocator& allocator, bench_device& device, const std::vector<bench_stream>& streams,
                        const std::vector<mixed_sequence>& sequences, const run_plan& plan);
// Free on one stream, allocate on another: alloc+free of `bytes` on stream
// a, then alloc+free on stream b, alternating (two pairs per iteration).
measurement run_cross_stream(bench_allocator& allocator, bench_device& device, bench_stream a, bench_stream b,
                             std::size_t bytes, const run_plan& plan);

}  // namespace streamalloc::bench
