// A caching_allocator on a fresh sim_backend, plus the checks every
// allocator test repeats: validate(), the independent stats recount, and the
// device-side accounting (sim used bytes == reserved bytes).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"
#include "support/recount.hpp"

namespace streamalloc::test {

inline std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Devices for the plain-segment tests: without virtual memory the
// allocator uses one device allocation per segment whatever its config says
// (expandable segments are tested in expandable_segments_test.cpp).
inline sim_config plain_device(std::size_t capacity_bytes = 80_GiB) {
  sim_config c;
  c.capacity_bytes = capacity_bytes;
  c.virtual_memory = false;
  return c;
}

// A device with virtual memory (2 MiB granularity): the allocator's
// default config uses expandable segments on it.
inline sim_config vmm_device(std::size_t capacity_bytes = 80_GiB, bool manual_events = false) {
  sim_config c;
  c.capacity_bytes = capacity_bytes;
  c.events_complete_immediately = !manual_events;
  c.virtual_memory = true;
  return c;
}

// A sim device whose events stay pending until the test completes them.
inline sim_config manual_events(std::size_t capacity_bytes = 80_GiB) {
  sim_config c = plain_device(capacity_bytes);
  c.events_complete_immediately = false;
  return c;
}

inline sim_config immediate_events(std::size_t capacity_bytes = 80_GiB) {
  sim_config c = plain_device(capacity_bytes);
  c.events_complete_immediately = true;
  return c;
}

// The intended size policy with default constants, written out
// independently of size_policy so the tests check it rather than mirror it.
inline std::size_t expected_rounded_bytes(std::size_t requested) {
  if (requested < 512) return 512;
  return (requested + 511) / 512 * 512;
}

inline std::size_t expected_segment_bytes(std::size_t requested) {
  const std::size_t rounded = expected_rounded_bytes(requested);
  if (rounded <= 1_MiB) return 2_MiB;
  if (rounded < 10_MiB) return 20_MiB;
  return (rounded + 2_MiB - 1) / 2_MiB * 2_MiB;
}

// The snapshot block that starts at `address`, or nullptr.
inline const block_info* find_block(const allocator_snapshot& snapshot, std::uintptr_t address) {
  for (const segment_info& seg : snapshot.segments) {
    if (address < seg.address || address >= seg.address + seg.total_size) continue;
    for (const block_info& b : seg.blocks) {
      if (b.address == address) return &b;
    }
  }
  return nullptr;
}

// The snapshot segment containing `address`, or nullptr.
inline const segment_info* find_segment(const allocator_snapshot& snapshot, std::uintptr_t address) {
  for (const segment_info& seg : snapshot.segments) {
    if (address >= seg.address && address < seg.address + seg.total_size) return &seg;
  }
  return nullptr;
}

inline std::size_t count_state(const allocator_snapshot& snapshot, block_state state) {
  std::size_t n = 0;
  for (const segment_info& seg : snapshot.segments) {
    for (const block_info& b : seg.blocks) n += b.state == state ? 1 : 0;
  }
  return n;
}

inline std::int64_t all(const stat_array& a) { return a[static_cast<int>(stat_type::all)].current; }
inline std::int64_t small_pool(const stat_array& a) { return a[static_cast<int>(stat_type::small_pool)].current; }
inline std::int64_t large_pool(const stat_array& a) { return a[static_cast<int>(stat_type::large_pool)].current; }

// Everything the allocator, its stats and the device agree on, or "" when
// they do. Usable where Catch assertions are too slow (randomized loops).
// `allocator_type`: caching_allocator, or device_allocator (every arena).
template <typename allocator_type>
std::string consistency_problem(const allocator_type& alloc, const sim_backend& sim) {
  try {
    alloc.validate();
  } catch (const std::logic_error& e) {
    return std::string("validate() threw: ") + e.what();
  }
  const allocator_snapshot snap = alloc.snapshot();
  std::string problem = check_snapshot_shape(snap, alloc.config().min_block_bytes);
  if (!problem.empty()) return "snapshot: " + problem;
  const device_stats stats = alloc.stats();
  problem = compare_stats(stats, recount(snap, alloc.config().max_split_bytes));
  if (!problem.empty()) return "stats vs recount: " + problem;
  for (const segment_info& seg : snap.segments) {
    if (!sim.is_device_memory(reinterpret_cast<const void*>(seg.address), seg.total_size)) {
      return "a snapshot segment is not live sim device memory";
    }
    if (seg.device != sim.device_index()) return "a snapshot segment has the wrong device index";
  }
  if (static_cast<std::int64_t>(sim.used_bytes()) != all(stats.reserved_bytes)) {
    return "sim used_bytes " + std::to_string(sim.used_bytes()) + " != reserved_bytes " +
           std::to_string(all(stats.reserved_bytes));
  }
  // Expandable segments report mapped runs as segments; the device only
  // knows plain segments, ranges and chunks.
  const auto plain_segments = static_cast<std::size_t>(std::count_if(
      snap.segments.begin(), snap.segments.end(), [](const segment_info& seg) { return !seg.is_expandable; }));
  if (sim.live_segments() != plain_segments) {
    return "sim live_segments " + std::to_string(sim.live_segments()) + " != plain segments in the snapshot " +
           std::to_string(plain_segments);
  }
  if (static_cast<std::int64_t>(sim.mapped_chunks()) != stats.mapped_chunks.current) {
    return "sim mapped_chunks " + std::to_string(sim.mapped_chunks()) + " != vmm.mapped_chunks " +
           std::to_string(stats.mapped_chunks.current);
  }
  if (sim.live_chunks() != sim.mapped_chunks()) {
    return "the device holds " + std::to_string(sim.live_chunks() - sim.mapped_chunks()) + " chunks mapped nowhere";
  }
  if (sim.counters().unsafe_unmaps != 0) return "the allocator unmapped memory a stream may still use";
  return {};
}

struct sim_fixture {
  explicit sim_fixture(sim_config sim_cfg = plain_device(), allocator_config cfg = {})
      : sim(sim_cfg), alloc(sim, cfg), s1(sim.new_stream()), s2(sim.new_stream()), s3(sim.new_stream()) {}

  // Fails the running test with the first inconsistency found.
  void check_consistent() const {
    const std::string problem = consistency_problem(alloc, sim);
    INFO(problem);
    REQUIRE(problem.empty());
  }

  device_stats stats() const { return alloc.stats(); }
  allocator_snapshot snapshot() const { return alloc.snapshot(); }

  sim_backend sim;
  caching_allocator alloc;
  stream_handle s1;
  stream_handle s2;
  stream_handle s3;
};

// The events `action` recorded, on a sim whose events stay pending: the
// newest pending records, as many as the action made. (A set difference of
// the pending lists would miss an event the allocator re-records while its
// previous record is still pending, as it may after a cross-stream wait.)
template <typename Action>
std::vector<event_handle> new_pending_events(const sim_backend& sim, Action&& action) {
  const std::size_t records_before = sim.counters().event_records;
  action();
  const std::size_t recorded = sim.counters().event_records - records_before;
  const std::vector<event_handle> pending = sim.pending_events();
  const std::size_t n = std::min(recorded, pending.size());
  return std::vector<event_handle>(pending.end() - static_cast<std::ptrdiff_t>(n), pending.end());
}

// On an expandable device: [hole 4 MiB][kept 2 MiB][hole 4 MiB][kept
// 2 MiB] mapped for `stream`, the holes freed (four idle chunks a stitch
// can move). Returns the two kept blocks.
inline std::vector<void*> make_two_holes(sim_fixture& f, stream_handle stream) {
  void* hole1 = f.alloc.allocate(4_MiB, stream);
  void* kept1 = f.alloc.allocate(2_MiB, stream);
  void* hole2 = f.alloc.allocate(4_MiB, stream);
  void* kept2 = f.alloc.allocate(2_MiB, stream);
  REQUIRE(addr(kept1) == addr(hole1) + 4_MiB);
  REQUIRE(addr(hole2) == addr(kept1) + 2_MiB);
  REQUIRE(addr(kept2) == addr(hole2) + 4_MiB);
  f.alloc.free(hole1);
  f.alloc.free(hole2);
  return {kept1, kept2};
}

}  // namespace streamalloc::test
