// Counters with the names and meaning of torch.cuda.memory_stats(), plus
// fragmentation metrics that PyTorch does not report.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace streamalloc {

// One counter in torch's shape: current/peak/allocated(ever added)/freed.
struct stat_counter {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) {
    current -= amount;
    freed += amount;
  }
  // A decrease and an increase of `amount` that left current as it was.
  void count_cycles(std::int64_t amount) {
    allocated += amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = 0, freed = 0; }
};

// Index into a stat_array: torch's "all", "small_pool", "large_pool".
enum class stat_type : int { all = 0, small_pool = 1, large_pool = 2 };
constexpr int k_stat_type_count = 3;
using stat_array = std::array<stat_counter, k_stat_type_count>;

// A stat_array's slot by name, and the slot of a pool kind.
inline stat_counter& at(stat_array& array, stat_type type) { return array[static_cast<std::size_t>(type)]; }
inline const stat_counter& at(const stat_array& array, stat_type type) {
  return array[static_cast<std::size_t>(type)];
}
inline stat_type pool_stat(bool is_small) { return is_small ? stat_type::small_pool : stat_type::large_pool; }

struct device_stats {
  stat_array allocation;           // number of allocated blocks
  stat_array segment;              // number of segments
  stat_array active;               // allocated + awaiting their events
  stat_array inactive_split;       // free blocks in partly used segments
  stat_array allocated_bytes;
  stat_array reserved_bytes;
  stat_array active_bytes;
  stat_array inactive_split_bytes;
  stat_array requested_bytes;      // bytes the callers asked for
  stat_counter oversize_allocations;
  stat_counter oversize_segments;
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  std::int64_t num_cross_stream_reuses = 0;
  std::int64_t num_recent_reuses = 0;  // allocations served by a recent free (Note [recent frees])
  std::int64_t num_combined_calls = 0;  // calls run by another thread's hold of the lock (Note [combined calls])
  std::int64_t max_split_size = 0;  // -1 when unlimited, like torch

  // Expandable segments (under "vmm.*"): chunks mapped now, map and unmap
  // calls, allocations served by stitched chunks, and the stream
  // synchronizations stitching waited for.
  stat_counter mapped_chunks;
  std::int64_t num_chunk_maps = 0;
  std::int64_t num_chunk_unmaps = 0;
  std::int64_t num_stitched_blocks = 0;
  std::int64_t num_stitch_syncs = 0;

  // Fragmentation (computed at read time from the free cached blocks).
  std::int64_t largest_free_block_bytes = 0;
  std::int64_t free_cached_bytes = 0;
  // 1 - largest free / total free (0 when nothing is free).
  double external_fragmentation = 0.0;
  // reserved / allocated (current), 0 when nothing is allocated.
  double reserved_allocated_ratio = 0.0;

  // The fields of each kind, for code that treats them all alike (resets,
  // the sums of Note [arenas]). max_split_size and the fragmentation
  // entries are in none: they are settings and readings, not counts.
  static constexpr stat_array device_stats::*k_arrays[] = {
      &device_stats::allocation,     &device_stats::segment,      &device_stats::active,
      &device_stats::inactive_split, &device_stats::allocated_bytes, &device_stats::reserved_bytes,
      &device_stats::active_bytes,   &device_stats::inactive_split_bytes, &device_stats::requested_bytes};
  static constexpr stat_counter device_stats::*k_counters[] = {
      &device_stats::oversize_allocations, &device_stats::oversize_segments, &device_stats::mapped_chunks};
  static constexpr std::int64_t device_stats::*k_totals[] = {
      &device_stats::num_alloc_retries,   &device_stats::num_ooms,          &device_stats::num_sync_all_streams,
      &device_stats::num_device_alloc,    &device_stats::num_device_free,   &device_stats::num_cross_stream_reuses,
      &device_stats::num_recent_reuses,   &device_stats::num_combined_calls, &device_stats::num_chunk_maps,
      &device_stats::num_chunk_unmaps,    &device_stats::num_stitched_blocks, &device_stats::num_stitch_syncs};

  // Flattened like torch.cuda.memory_stats(): "allocated_bytes.all.current".
  // Fragmentation entries are under "fragmentation.*".
  std::map<std::string, double> to_map() const;
};

}  // namespace streamalloc
