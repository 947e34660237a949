// Trace replay: one untimed pass checks the trace and computes its own
// figures (peak live bytes, native reserved memory), then a timed pass makes
// only the allocate/free calls and the address-map updates they need.
#include "trace_replay.hpp"

#include <algorithm>
#include <chrono>
#include <unordered_map>

namespace streamalloc {
namespace {

struct trace_figures {
  std::uint64_t allocs = 0;
  std::uint64_t frees = 0;
  std::uint64_t live_at_end = 0;
  std::size_t peak_live_allocations = 0;
  std::size_t peak_live_bytes = 0;
  std::uint64_t native_segment_allocs = 0;
  std::uint64_t native_segment_maps = 0;
  std::size_t native_peak_reserved_bytes = 0;
  std::size_t native_reserved_before_recording_bytes = 0;
  bool native_recorded = false;  // any segment event
  std::uint64_t allocs_before_recording = 0;
  std::uint64_t bytes_before_recording = 0;
};

constexpr int k_all = static_cast<int>(stat_type::all);

// Validates the alloc/free pairing so the timed pass can trust it.
trace_figures examine_trace(const std::vector<trace_file_event>& events, const std::string& path) {
  trace_figures figures;
  std::unordered_map<std::uint64_t, std::uint64_t> live_sizes;  // trace address -> requested size
  std::uint64_t live_bytes = 0;
  // Signed: recording may start after segments were made, so frees can
  // outnumber allocations early in a trace. What native reserved before
  // recording began is the least that keeps every live byte of the trace
  // (those allocated before it too) inside reserved memory.
  std::int64_t native_reserved = 0;
  std::int64_t native_peak = 0;
  std::int64_t native_before = 0;
  for (const trace_file_event& e : events) {
    switch (e.action) {
      case trace_file_action::alloc: {
        if (!live_sizes.emplace(e.addr, e.size).second) {
          throw trace_error(path, e.line, "alloc at address " + std::to_string(e.addr) + ", which is already live");
        }
        ++figures.allocs;
        if (e.before_recording) {
          ++figures.allocs_before_recording;
          figures.bytes_before_recording += e.size;
        }
        live_bytes += e.size;
        native_before = std::max(native_before, static_cast<std::int64_t>(live_bytes) - native_reserved);
        figures.peak_live_bytes = std::max<std::size_t>(figures.peak_live_bytes, live_bytes);
        figures.peak_live_allocations = std::max(figures.peak_live_allocations, live_sizes.size());
        break;
      }
      case trace_file_action::free_completed: {
        const auto it = live_sizes.find(e.addr);
        if (it == live_sizes.end()) {
          throw trace_error(path, e.line, "free_completed of address " + std::to_string(e.addr) + ", which is not live");
        }
        if (it->second != 0) ++figures.frees;
        live_bytes -= it->second;
        live_sizes.erase(it);
        break;
      }
      case trace_file_action::segment_alloc:
      case trace_file_action::segment_map:
        figures.native_recorded = true;
        ++(e.action == trace_file_action::segment_alloc ? figures.native_segment_allocs : figures.native_segment_maps);
        native_reserved += static_cast<std::int64_t>(e.size);
        native_peak = std::max(native_peak, native_reserved);
        break;
      case trace_file_action::segment_free:
      case trace_file_action::segment_unmap:
        figures.native_recorded = true;
        native_reserved -= static_cast<std::int64_t>(e.size);
        native_before = std::max(native_before, static_cast<std::int64_t>(live_bytes) - native_reserved);
        break;
      case trace_file_action::free_requested:
      case trace_file_action::other:
        break;
    }
  }
  // A ratio of nothing would print as 0 and pass for a result.
  if (events.empty()) throw trace_error(path, 0, "no events after the header: nothing to replay");
  if (figures.peak_live_bytes == 0) {
    throw trace_error(path, 0, "no alloc event of more than 0 bytes in " + std::to_string(events.size()) +
                                   " events: nothing to measure");
  }
  figures.live_at_end = live_sizes.size();
  if (figures.native_recorded) {
    figures.native_reserved_before_recording_bytes = static_cast<std::size_t>(native_before);
    figures.native_peak_reserved_bytes = static_cast<std::size_t>(native_before + native_peak);
  }
  return figures;
}

double ratio(std::size_t numerator, std::size_t denominator) {
  return denominator == 0 ? 0.0 : static_cast<double>(numerator) / static_cast<double>(denominator);
}

void free_all(std::unordered_map<std::uint64_t, void*>& live, caching_allocator& allocator) {
  for (const auto& entry : live) {
    if (entry.second != nullptr) allocator.free(entry.second);
  }
  live.clear();
}

}  // namespace

replay_out_of_memory::replay_out_of_memory(const std::string& path, std::uint64_t line, std::uint64_t bytes,
                                           const out_of_memory& cause)
    : std::runtime_error(path + ":" + std::to_string(line) + ": out of memory replaying an alloc of " +
                         std::to_string(bytes) + " bytes: " + cause.what()),
      context_(cause.context()),
      line_(line) {}

void remap_streams_to_sim(std::vector<trace_file_event>& events, sim_backend& device) {
  std::unordered_map<std::uint64_t, stream_handle> streams;
  for (trace_file_event& e : events) {
    if (e.stream == 0) continue;
    auto it = streams.find(e.stream);
    if (it == streams.end()) it = streams.emplace(e.stream, device.new_stream()).first;
    e.stream = it->second;
  }
}

replay_result replay_trace(const std::vector<trace_file_event>& events, caching_allocator& allocator,
                           const std::string& path) {
  const trace_figures figures = examine_trace(events, path);

  std::unordered_map<std::uint64_t, void*> live;  // trace address -> allocator pointer
  live.reserve(figures.peak_live_allocations);
  allocator.reset_peak_stats();
  const device_stats before = allocator.stats();

  const trace_file_event* current = nullptr;
  std::chrono::steady_clock::duration elapsed{};
  try {
    const auto start = std::chrono::steady_clock::now();
    for (const trace_file_event& e : events) {
      current = &e;
      if (e.action == trace_file_action::alloc) {
        live.emplace(e.addr, allocator.allocate(e.size, static_cast<stream_handle>(e.stream)));
      } else if (e.action == trace_file_action::free_completed) {
        const auto it = live.find(e.addr);
        void* ptr = it->second;
        live.erase(it);
        if (ptr != nullptr) allocator.free(ptr);
      }
    }
    elapsed = std::chrono::steady_clock::now() - start;
  } catch (const out_of_memory& oom) {
    free_all(live, allocator);
    throw replay_out_of_memory(path, current->line, current->size, oom);
  } catch (...) {
    free_all(live, allocator);
    throw;
  }

  const device_stats stats = allocator.stats();
  free_all(live, allocator);

  replay_result result;
  result.events = events.size();
  result.allocs = figures.allocs;
  result.frees = figures.frees;
  result.ops = figures.allocs + figures.frees;
  result.live_at_end = figures.live_at_end;
  result.trace_peak_live_bytes = figures.peak_live_bytes;
  result.peak_allocated_bytes = static_cast<std::size_t>(stats.requested_bytes[k_all].peak);
  result.peak_reserved_bytes = static_cast<std::size_t>(stats.reserved_bytes[k_all].peak);
  result.frag_ratio = ratio(result.peak_reserved_bytes, result.peak_allocated_bytes);
  result.segments = stats.num_device_alloc - before.num_device_alloc;
  result.chunk_maps = stats.num_chunk_maps - before.num_chunk_maps;
  result.chunk_unmaps = stats.num_chunk_unmaps - before.num_chunk_unmaps;
  result.stitched_blocks = stats.num_stitched_blocks - before.num_stitched_blocks;
  result.stitch_syncs = stats.num_stitch_syncs - before.num_stitch_syncs;
  result.cross_stream_reuses = stats.num_cross_stream_reuses - before.num_cross_stream_reuses;
  result.total_ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count());
  result.ns_per_op = result.ops == 0 ? 0.0 : static_cast<double>(result.total_ns) / static_cast<double>(result.ops);
  result.native_segment_allocs = figures.native_segment_allocs;
  result.native_segment_maps = figures.native_segment_maps;
  result.native_recorded = figures.native_recorded;
  result.native_segments = figures.native_segment_allocs + figures.native_segment_maps;
  result.native_peak_reserved_bytes = figures.native_peak_reserved_bytes;
  result.native_reserved_before_recording_bytes = figures.native_reserved_before_recording_bytes;
  result.allocs_before_recording = figures.allocs_before_recording;
  result.bytes_before_recording = figures.bytes_before_recording;
  result.native_frag_ratio = ratio(figures.native_peak_reserved_bytes, figures.peak_live_bytes);
  return result;
}

}  // namespace streamalloc
