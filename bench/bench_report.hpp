// Output of streamalloc-bench: markdown tables on stdout (one per pattern,
// an allocator per column, plus the speed-up of streamalloc over torch's
// native allocator when both ran) and the same figures as JSON.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench_patterns.hpp"

namespace streamalloc::bench {

struct run_info {
  std::string device;
  std::string mode;  // "full" or "smoke", and any count overrides
  std::string thread_streams;  // "own" (a stream per thread) or "shared"
  std::string thread_workload;  // the per-thread sequence, for the threads heading
  std::uint64_t seed = 0;
  run_plan plan;
  std::vector<std::string> allocators;  // column order
  std::vector<std::pair<std::string, std::string>> settings;  // allocator -> its settings
  std::vector<std::string> notes;  // allocators skipped and why, failures
};

void print_tables(const run_info& info, const std::vector<measurement>& results);
// Throws std::runtime_error when the file cannot be written.
void write_json(const std::string& path, const run_info& info, const std::vector<measurement>& results);

}  // namespace streamalloc::bench
