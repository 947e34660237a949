#include "peak_anatomy.hpp"

#include <algorithm>

#include "replay_calls.hpp"

namespace streamalloc {
namespace {

constexpr int k_all = static_cast<int>(stat_type::all);

std::size_t reserved_now(const caching_allocator& allocator) {
  return static_cast<std::size_t>(allocator.stats().reserved_bytes[k_all].current);
}

// A mapped run's free bytes split by chunks of `chunk` bytes from its
// start: in idle chunks (no block in use) and in chunks that hold one.
void split_free(const segment_info& s, std::size_t chunk, std::size_t* idle, std::size_t* partly_used) {
  // Bytes in use per chunk of the run; a chunk with none is idle.
  std::vector<std::size_t> used((s.total_size + chunk - 1) / chunk, 0);
  std::size_t free_bytes = 0;
  for (const block_info& b : s.blocks) {
    if (b.state == block_state::inactive) {
      free_bytes += b.size;
      continue;
    }
    const std::uintptr_t from = b.address - s.address;
    const std::uintptr_t to = from + b.size;
    for (std::size_t c = from / chunk; c < used.size() && c * chunk < to; ++c) {
      used[c] += std::min<std::uintptr_t>(to, (c + 1) * chunk) - std::max<std::uintptr_t>(from, c * chunk);
    }
  }
  *idle = static_cast<std::size_t>(std::count(used.begin(), used.end(), std::size_t{0})) * chunk;
  *partly_used = free_bytes - *idle;
}

// Adds the free bytes of `s` to `out`, cut into chunks of `chunk` bytes
// from its start when it is a mapped run of an expandable segment.
void count_free(const segment_info& s, std::size_t chunk, peak_anatomy* out) {
  for (const block_info& b : s.blocks) {
    if (b.state == block_state::active_allocated) {
      out->requested_bytes += b.requested_size;
      out->rounding_bytes += b.size - b.requested_size;
    } else if (b.state == block_state::active_pending_free) {
      out->pending_free_bytes += b.size;
    }
  }
  if (!s.is_expandable || chunk == 0) {
    for (const block_info& b : s.blocks) {
      if (b.state == block_state::inactive) out->plain_free_bytes += b.size;
    }
    return;
  }
  ++out->mapped_runs;
  std::size_t idle = 0;
  std::size_t partly_used = 0;
  split_free(s, chunk, &idle, &partly_used);
  out->idle_chunk_bytes += idle;
  out->partly_used_free_bytes += partly_used;
}

// The default pool's mapped runs, most free bytes in partly used chunks first.
std::vector<peak_run> list_mapped_runs(const caching_allocator& allocator) {
  const std::size_t chunk = allocator.config().vmm_chunk_bytes;
  std::vector<peak_run> runs;
  for (const segment_info& s : allocator.snapshot().segments) {
    if (s.pool != 0 || !s.is_expandable || chunk == 0) continue;
    peak_run run;
    run.bytes = s.total_size;
    run.small = s.is_small;
    for (const block_info& b : s.blocks) {
      if (b.state == block_state::inactive) continue;
      ++run.blocks_in_use;
      run.bytes_in_use += b.size;
    }
    split_free(s, chunk, &run.idle_chunk_bytes, &run.partly_used_free_bytes);
    runs.push_back(run);
  }
  std::stable_sort(runs.begin(), runs.end(), [](const peak_run& a, const peak_run& b) {
    return a.partly_used_free_bytes > b.partly_used_free_bytes;
  });
  return runs;
}

}  // namespace

std::size_t idle_chunk_bytes_after(const peak_anatomy& a) {
  std::size_t bytes = 0;
  for (const peak_run& run : a.runs_after) bytes += run.idle_chunk_bytes;
  return bytes;
}

peak_anatomy examine_reserved_peak(const std::vector<trace_file_event>& events,
                                   const std::function<std::unique_ptr<caching_allocator>()>& make_allocator) {
  peak_anatomy out;
  {
    // Only an allocation raises reserved memory: the first one after which
    // it stands at its highest set the peak.
    std::unique_ptr<caching_allocator> allocator = make_allocator();
    std::size_t previous = reserved_now(*allocator);
    std::uint64_t pending_op = 0;
    const trace_file_event* pending = nullptr;
    const auto settle = [&] {
      const std::size_t reserved = reserved_now(*allocator);
      if (pending != nullptr && reserved > previous && reserved > out.reserved_after) {
        out = peak_anatomy{};
        out.found = true;
        out.op = pending_op;
        out.line = pending->line;
        out.before_recording = pending->before_recording;
        out.request_bytes = pending->size;
        out.stream = pending->stream;
        out.reserved_after = reserved;
      }
      previous = reserved;
    };
    replay_calls(events, *allocator, [&](std::uint64_t op, const trace_file_event& e) {
      settle();
      pending_op = op;
      pending = &e;
      return true;
    }, [](std::uint64_t) {});
    settle();
  }
  if (!out.found) return out;

  // The same replay again, reading the statistics at the same points (so
  // that it takes the same path), stopped at that allocation.
  std::unique_ptr<caching_allocator> allocator = make_allocator();
  replay_calls(events, *allocator, [&](std::uint64_t op, const trace_file_event& e) {
    out.reserved_before = reserved_now(*allocator);
    if (op != out.op) return true;
    const std::size_t chunk = allocator->config().vmm_chunk_bytes;
    for (const segment_info& s : allocator->snapshot().segments) {
      if (s.pool == 0) count_free(s, chunk, &out);
    }
    const device_stats before = allocator->stats();
    void* ptr = allocator->allocate(e.size, static_cast<stream_handle>(e.stream));
    const device_stats after = allocator->stats();
    const auto grew = [&](std::int64_t device_stats::*counter) {
      return static_cast<std::size_t>(after.*counter - before.*counter);
    };
    out.call_chunk_maps = grew(&device_stats::num_chunk_maps);
    out.call_chunk_unmaps = grew(&device_stats::num_chunk_unmaps);
    out.call_stitch_syncs = grew(&device_stats::num_stitch_syncs);
    out.call_device_allocs = grew(&device_stats::num_device_alloc);
    out.call_device_frees = grew(&device_stats::num_device_free);
    out.repeated = reserved_now(*allocator) == out.reserved_after;
    out.runs_after = list_mapped_runs(*allocator);
    allocator->free(ptr);
    return false;
  }, [](std::uint64_t) {});
  return out;
}

}  // namespace streamalloc
