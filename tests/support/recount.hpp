// Independent recount of the allocator's statistics from snapshot(), and a
// shape check of the snapshot itself. Tests compare stats() against this so
// the allocator's incremental counters are never trusted on their own word.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "streamalloc/core/snapshot.hpp"
#include "streamalloc/core/stats.hpp"

namespace streamalloc::test {

using stat_values = std::array<std::int64_t, k_stat_type_count>;

// Current values that stats() must report, derived from the blocks alone.
struct recounted_stats {
  stat_values allocation{};
  stat_values segment{};
  stat_values active{};
  stat_values inactive_split{};
  stat_values allocated_bytes{};
  stat_values reserved_bytes{};
  stat_values active_bytes{};
  stat_values inactive_split_bytes{};
  stat_values requested_bytes{};
  std::int64_t oversize_allocations = 0;
  std::int64_t oversize_segments = 0;
  std::int64_t largest_free_block_bytes = 0;
  std::int64_t free_cached_bytes = 0;
  std::int64_t pending_free_blocks = 0;
};

namespace detail {

inline void add(stat_values& values, bool is_small, std::int64_t amount) {
  values[static_cast<int>(stat_type::all)] += amount;
  values[static_cast<int>(is_small ? stat_type::small_pool : stat_type::large_pool)] += amount;
}

inline const char* stat_type_name(int index) {
  static const char* const names[k_stat_type_count] = {"all", "small_pool", "large_pool"};
  return names[index];
}

}  // namespace detail

// `max_split_bytes` is the allocator's config value (blocks and segments of
// at least this size are oversize).
inline recounted_stats recount(const allocator_snapshot& snapshot, std::size_t max_split_bytes) {
  recounted_stats r;
  for (const segment_info& seg : snapshot.segments) {
    const auto total = static_cast<std::int64_t>(seg.total_size);
    detail::add(r.segment, seg.is_small, 1);
    detail::add(r.reserved_bytes, seg.is_small, total);
    // Oversize segments are device allocations; mapped runs never are.
    if (seg.total_size >= max_split_bytes && !seg.is_expandable) ++r.oversize_segments;
    const bool split_segment = seg.blocks.size() > 1;
    for (const block_info& b : seg.blocks) {
      const auto size = static_cast<std::int64_t>(b.size);
      switch (b.state) {
        case block_state::active_allocated:
          detail::add(r.allocation, seg.is_small, 1);
          detail::add(r.allocated_bytes, seg.is_small, size);
          detail::add(r.active, seg.is_small, 1);
          detail::add(r.active_bytes, seg.is_small, size);
          detail::add(r.requested_bytes, seg.is_small, static_cast<std::int64_t>(b.requested_size));
          if (b.size >= max_split_bytes) ++r.oversize_allocations;
          break;
        case block_state::active_pending_free:
          detail::add(r.active, seg.is_small, 1);
          detail::add(r.active_bytes, seg.is_small, size);
          ++r.pending_free_blocks;
          break;
        case block_state::inactive:
          if (split_segment) {
            detail::add(r.inactive_split, seg.is_small, 1);
            detail::add(r.inactive_split_bytes, seg.is_small, size);
          }
          r.free_cached_bytes += size;
          if (size > r.largest_free_block_bytes) r.largest_free_block_bytes = size;
          break;
      }
    }
  }
  return r;
}

// "" when the snapshot is well formed, else a description of the first
// problem: segments ordered and disjoint, blocks tiling each segment in
// address order, per-segment sums, no two address-adjacent free blocks of
// one stream (they should have been coalesced).
inline std::string check_snapshot_shape(const allocator_snapshot& snapshot, std::size_t min_block_bytes) {
  std::ostringstream out;
  std::uintptr_t previous_end = 0;
  for (std::size_t si = 0; si < snapshot.segments.size(); ++si) {
    const segment_info& seg = snapshot.segments[si];
    out << std::hex << "segment 0x" << seg.address << std::dec << " (" << seg.total_size << " B): ";
    if (seg.address < previous_end) return out.str() + "not in address order or overlaps the previous segment";
    previous_end = seg.address + seg.total_size;
    if (seg.blocks.empty()) return out.str() + "has no blocks";
    std::uintptr_t cursor = seg.address;
    std::size_t allocated = 0, active = 0, requested = 0;
    const block_info* previous = nullptr;
    for (const block_info& b : seg.blocks) {
      if (b.address != cursor) {
        out << std::hex << "block at 0x" << b.address << " does not start where the previous ends (0x" << cursor << ")";
        return out.str();
      }
      if (b.size == 0 || b.size % min_block_bytes != 0) {
        out << "block size " << b.size << " is not a positive multiple of " << min_block_bytes;
        return out.str();
      }
      cursor += b.size;
      requested += b.requested_size;
      if (b.state == block_state::active_allocated) {
        allocated += b.size;
        if (b.requested_size == 0 || b.requested_size > b.size) {
          out << "allocated block of " << b.size << " B has requested_size " << b.requested_size;
          return out.str();
        }
      }
      if (b.state != block_state::inactive) active += b.size;
      if (b.state == block_state::inactive && b.requested_size != 0) {
        out << "free block has requested_size " << b.requested_size;
        return out.str();
      }
      if (previous != nullptr && previous->state == block_state::inactive && b.state == block_state::inactive &&
          previous->stream == b.stream) {
        out << std::hex << "free blocks at 0x" << previous->address << " and 0x" << b.address
            << " of one stream were not coalesced";
        return out.str();
      }
      previous = &b;
    }
    if (cursor != seg.address + seg.total_size) return out.str() + "blocks do not cover the segment exactly";
    if (allocated != seg.allocated_size) {
      out << "allocated_size " << seg.allocated_size << " != sum of allocated blocks " << allocated;
      return out.str();
    }
    if (active != seg.active_size) {
      out << "active_size " << seg.active_size << " != sum of active blocks " << active;
      return out.str();
    }
    if (requested != seg.requested_size) {
      out << "requested_size " << seg.requested_size << " != sum of block requested sizes " << requested;
      return out.str();
    }
    out.str("");
  }
  return {};
}

// "" when every current value of `stats` equals the recount (and peaks are
// not below currents), else the first mismatch.
inline std::string compare_stats(const device_stats& stats, const recounted_stats& r) {
  std::ostringstream out;
  const auto check_array = [&](const char* name, const stat_array& actual, const stat_values& expected) {
    for (int t = 0; t < k_stat_type_count; ++t) {
      const stat_counter& c = actual[static_cast<std::size_t>(t)];
      if (c.current != expected[static_cast<std::size_t>(t)]) {
        out << name << "." << detail::stat_type_name(t) << ".current is " << c.current << ", recount "
            << expected[static_cast<std::size_t>(t)];
        return false;
      }
      if (c.peak < c.current) {
        out << name << "." << detail::stat_type_name(t) << ".peak " << c.peak << " < current " << c.current;
        return false;
      }
    }
    return true;
  };
  const auto check_value = [&](const char* name, std::int64_t actual, std::int64_t expected) {
    if (actual == expected) return true;
    out << name << " is " << actual << ", recount " << expected;
    return false;
  };
  const bool ok =
      check_array("allocation", stats.allocation, r.allocation) && check_array("segment", stats.segment, r.segment) &&
      check_array("active", stats.active, r.active) &&
      check_array("inactive_split", stats.inactive_split, r.inactive_split) &&
      check_array("allocated_bytes", stats.allocated_bytes, r.allocated_bytes) &&
      check_array("reserved_bytes", stats.reserved_bytes, r.reserved_bytes) &&
      check_array("active_bytes", stats.active_bytes, r.active_bytes) &&
      check_array("inactive_split_bytes", stats.inactive_split_bytes, r.inactive_split_bytes) &&
      check_array("requested_bytes", stats.requested_bytes, r.requested_bytes) &&
      check_value("oversize_allocations.current", stats.oversize_allocations.current, r.oversize_allocations) &&
      check_value("oversize_segments.current", stats.oversize_segments.current, r.oversize_segments) &&
      check_value("largest_free_block_bytes", stats.largest_free_block_bytes, r.largest_free_block_bytes) &&
      check_value("free_cached_bytes", stats.free_cached_bytes, r.free_cached_bytes);
  if (!ok) return out.str();

  const double free_bytes = static_cast<double>(r.free_cached_bytes);
  const double expected_fragmentation =
      r.free_cached_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(r.largest_free_block_bytes) / free_bytes;
  if (std::fabs(stats.external_fragmentation - expected_fragmentation) > 1e-9) {
    out << "external_fragmentation is " << stats.external_fragmentation << ", recount " << expected_fragmentation;
    return out.str();
  }
  const std::int64_t allocated = r.allocated_bytes[0];
  const double expected_ratio =
      allocated == 0 ? 0.0 : static_cast<double>(r.reserved_bytes[0]) / static_cast<double>(allocated);
  if (std::fabs(stats.reserved_allocated_ratio - expected_ratio) > 1e-9 * (1.0 + expected_ratio)) {
    out << "reserved_allocated_ratio is " << stats.reserved_allocated_ratio << ", recount " << expected_ratio;
    return out.str();
  }
  return {};
}

}  // namespace streamalloc::test
