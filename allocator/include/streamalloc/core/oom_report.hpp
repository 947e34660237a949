// oom_report: what an out-of-memory error can say beyond its numbers: who
// holds the memory (allocation tags), how fragmented the cache is, what
// still waits for other streams, and the one change most likely to help.
// Pure computation over figures read after the error; the torch layer
// appends describe() to torch's message and keeps the report as data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "streamalloc/core/allocation_tags.hpp"
#include "streamalloc/core/stats.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// Which situation the error is, in the order make_oom_report tests them.
enum class oom_case {
  request_exceeds_limit,  // the request alone is more than streamalloc may ever use
  pending_streams,        // freed memory still awaited by other streams would cover it
  fragmentation,          // enough reserved but unallocated memory, in pieces too small
  outside_memory,         // memory held outside streamalloc, more than its own, is missing
  near_limit,             // live tensors fill what streamalloc may use
};
const char* to_string(oom_case kind);  // "fragmentation", ...

// Live bytes held under one tag (see allocation_tags); the pseudo-tag
// k_before_tagging_name holds what was allocated before tagging started.
struct oom_holder {
  std::string tag;
  std::size_t bytes = 0;
  std::size_t count = 0;  // allocations (0 for the pseudo-tag: unknown)
};
constexpr const char* k_before_tagging_name = "before_tagging";

struct oom_report {
  oom_context context;
  // What streamalloc may reserve (the memory-fraction cap, else the device
  // total) and what it could have had at the error (the cap, or what it
  // reserved plus the device's free memory when that is less).
  std::size_t limit_bytes = 0;
  std::size_t available_bytes = 0;
  std::size_t allocated_bytes = 0;             // live tensors, read after the error
  std::size_t unallocated_bytes = 0;           // reserved - allocated, at the error
  std::size_t free_cached_bytes = 0;
  double external_fragmentation = 0.0;         // 1 - largest free block / free cached
  std::size_t pending_other_streams_bytes = 0; // freed, awaiting other streams (active - allocated)
  std::size_t outside_bytes = 0;               // used on the device beyond streamalloc's reservation
  bool tagging = false;
  bool sampled = false;                        // holders are estimates
  std::uint32_t sample_every = 1;
  std::vector<oom_holder> holders;             // most bytes first
  std::size_t other_holders = 0;               // tags left out of `holders`
  std::size_t other_holders_bytes = 0;
  oom_case kind = oom_case::near_limit;
  std::string suggestion;                      // one sentence
};

// `stats`: the device's counters read after the error; `tags`: the tag
// summary of the failing device, nullptr when tagging is off;
// `expandable_segments`: whether the default pool uses them.
oom_report make_oom_report(const oom_context& context, const device_stats& stats, const tag_summary* tags,
                           bool expandable_segments, std::size_t top = 5);

// Three lines for the error message: holders, fragmentation and pending
// memory, the suggestion.
std::string describe(const oom_report& report);

}  // namespace streamalloc
