// oom_report: see the header. The case and its suggestion are chosen from
// the figures alone, so the choice is tested on the simulated device.
#include "streamalloc/core/oom_report.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

namespace streamalloc {
namespace {

std::size_t minus(std::size_t a, std::size_t b) { return a > b ? a - b : 0; }

std::size_t current(const stat_array& array) {
  return array[0].current > 0 ? static_cast<std::size_t>(array[0].current) : 0;
}

std::string fixed(double value, const char* format) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

// Percentages are rounded up: "at least 7%" must be enough.
std::string percent_up(std::size_t part, std::size_t whole) {
  if (whole == 0) return "100%";
  const std::size_t p = (part * 100 + whole - 1) / whole;
  return std::to_string(std::min<std::size_t>(p, 100)) + "%";
}

std::vector<oom_holder> holders_of(const tag_summary& tags, std::size_t allocated) {
  std::vector<oom_holder> out;
  out.reserve(tags.by_tag.size() + 1);
  for (const tag_total& t : tags.by_tag) out.push_back({t.name, t.bytes, t.count});
  // Without sampling the records cover every allocation made since tagging
  // began; the rest of the live bytes predate it.
  if (!tags.sampled && allocated > tags.recorded_bytes) {
    out.push_back({k_before_tagging_name, allocated - tags.recorded_bytes, 0});
  }
  std::stable_sort(out.begin(), out.end(), [](const oom_holder& a, const oom_holder& b) { return a.bytes > b.bytes; });
  return out;
}

std::string suggest(const oom_report& r, bool expandable_segments) {
  const oom_context& c = r.context;
  const std::string gpu = "GPU " + std::to_string(c.device);
  switch (r.kind) {
    case oom_case::request_exceeds_limit: {
      std::string s = "the request alone (" + format_bytes(c.requested_bytes) + ") is more than the " +
                      format_bytes(r.limit_bytes) + " streamalloc may use on " + gpu +
                      ": shrink that tensor (a smaller batch or sequence length) or split the operation";
      if (r.limit_bytes < c.device_total_bytes) s += ", or raise torch.cuda.set_per_process_memory_fraction";
      return s + ".";
    }
    case oom_case::pending_streams:
      return format_bytes(r.pending_other_streams_bytes) +
             " of freed memory is still awaited by other streams (record_stream): synchronize them "
             "(torch.cuda.synchronize()) before this allocation, or call record_stream only for tensors "
             "those streams really use.";
    case oom_case::fragmentation:
      if (!expandable_segments) {
        return format_bytes(r.unallocated_bytes) + " is reserved but unallocated in pieces of at most " +
               format_bytes(c.largest_free_block_bytes) +
               ": set expandable_segments:True (streamalloc.install(expandable_segments=True) or "
               "STREAMALLOC_CONF) so freed memory can be remapped into one range.";
      }
      return format_bytes(r.unallocated_bytes) + " is reserved but unallocated in pieces of at most " +
             format_bytes(c.largest_free_block_bytes) +
             ": call torch.cuda.empty_cache() between program phases that allocate different shapes.";
    case oom_case::outside_memory:
      return format_bytes(r.outside_bytes) + " of " + gpu +
             " is used outside streamalloc (other processes, other allocators, the CUDA context), more than "
             "streamalloc holds itself: free it or move to a GPU with room (nvidia-smi lists the processes).";
    case oom_case::near_limit:
      break;
  }
  const std::size_t needed = minus(r.allocated_bytes + c.requested_bytes, r.available_bytes);
  std::string s = "live tensors take " + format_bytes(r.allocated_bytes) + " of the " +
                  format_bytes(r.available_bytes) + " streamalloc could use on " + gpu + " and this request needs " +
                  format_bytes(c.requested_bytes);
  if (needed > 0 && r.allocated_bytes > 0) {
    s += ": reduce the batch size by at least " + percent_up(needed, r.allocated_bytes) +
         " (if memory grows with it; streamalloc.max_batch_size() finds the largest that fits)";
  } else {
    s += ": reduce the batch size (streamalloc.max_batch_size() finds the largest that fits)";
  }
  return s + ", or free tensors kept across steps.";
}

}  // namespace

const char* to_string(oom_case kind) {
  switch (kind) {
    case oom_case::request_exceeds_limit:
      return "request_exceeds_limit";
    case oom_case::pending_streams:
      return "pending_streams";
    case oom_case::fragmentation:
      return "fragmentation";
    case oom_case::outside_memory:
      return "outside_memory";
    case oom_case::near_limit:
      return "near_limit";
  }
  return "unknown";
}

oom_report make_oom_report(const oom_context& context, const device_stats& stats, const tag_summary* tags,
                           bool expandable_segments, std::size_t top) {
  oom_report r;
  r.context = context;
  const oom_context& c = context;
  const bool capped = c.allowed_bytes > 0 && c.allowed_bytes < c.device_total_bytes;
  r.limit_bytes = capped ? c.allowed_bytes : c.device_total_bytes;
  r.available_bytes = std::min(r.limit_bytes, c.reserved_bytes + c.device_free_bytes);
  r.allocated_bytes = current(stats.allocated_bytes);
  r.unallocated_bytes = minus(c.reserved_bytes, c.allocated_bytes);
  r.free_cached_bytes = stats.free_cached_bytes > 0 ? static_cast<std::size_t>(stats.free_cached_bytes) : 0;
  r.external_fragmentation = stats.external_fragmentation;
  r.pending_other_streams_bytes = minus(current(stats.active_bytes), current(stats.allocated_bytes));
  r.outside_bytes = minus(minus(c.device_total_bytes, c.device_free_bytes), c.reserved_bytes);

  if (tags != nullptr) {
    r.tagging = true;
    r.sampled = tags->sampled;
    r.sample_every = tags->sample_every;
    std::vector<oom_holder> all = holders_of(*tags, r.allocated_bytes);
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (i < top) {
        r.holders.push_back(std::move(all[i]));
      } else {
        ++r.other_holders;
        r.other_holders_bytes += all[i].bytes;
      }
    }
  }

  if (c.requested_bytes > r.limit_bytes) {
    r.kind = oom_case::request_exceeds_limit;
  } else if (r.pending_other_streams_bytes >= c.requested_bytes) {
    r.kind = oom_case::pending_streams;
  } else if (r.unallocated_bytes >= c.requested_bytes && c.largest_free_block_bytes < c.requested_bytes) {
    r.kind = oom_case::fragmentation;
  } else if (r.available_bytes < r.limit_bytes && r.outside_bytes >= c.requested_bytes &&
             r.outside_bytes > c.reserved_bytes) {
    // The device's free memory binds before the cap, and others hold more
    // of it than streamalloc does.
    r.kind = oom_case::outside_memory;
  } else {
    r.kind = oom_case::near_limit;
  }
  r.suggestion = suggest(r, expandable_segments);
  return r;
}

std::string describe(const oom_report& r) {
  const std::string gpu = "GPU " + std::to_string(r.context.device);
  std::string holders;
  if (!r.tagging) {
    holders = "Holders by tag on " + gpu +
              ": unknown, tagging is off (streamalloc.enable_tagging(), streamalloc.tag(name) or "
              "streamalloc.attribute(model) record who allocates).";
  } else if (r.holders.empty()) {
    holders = "Holders by tag on " + gpu + ": none recorded.";
  } else {
    holders = "Top holders by tag on " + gpu + ": ";
    for (std::size_t i = 0; i < r.holders.size(); ++i) {
      const oom_holder& h = r.holders[i];
      if (i > 0) holders += ", ";
      holders += h.tag + " " + format_bytes(h.bytes);
      if (h.count > 0) holders += " (" + std::to_string(h.count) + (h.count == 1 ? " allocation)" : " allocations)");
    }
    if (r.other_holders > 0) {
      holders += ", " + std::to_string(r.other_holders) + " more " + format_bytes(r.other_holders_bytes);
    }
    if (r.sampled) holders += " (estimates: 1 in " + std::to_string(r.sample_every) + " small allocations recorded)";
    holders += ".";
  }
  const std::string memory = "Fragmentation: " + format_bytes(r.unallocated_bytes) +
                             " reserved but unallocated, largest free cached block " +
                             format_bytes(r.context.largest_free_block_bytes) + " (external fragmentation " +
                             fixed(r.external_fragmentation, "%.2f") + "); " +
                             format_bytes(r.pending_other_streams_bytes) + " freed but awaited by other streams.";
  std::string suggestion = r.suggestion;
  if (!suggestion.empty() && suggestion[0] >= 'a' && suggestion[0] <= 'z') {
    suggestion[0] = static_cast<char>(suggestion[0] - 'a' + 'A');
  }
  return holders + "\n" + memory + "\nSuggestion: " + suggestion;
}

}  // namespace streamalloc
