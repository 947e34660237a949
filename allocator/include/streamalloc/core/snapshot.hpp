// A point-in-time picture of every segment and block, in the shape of
// torch.cuda.memory._snapshot()["segments"].
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {

// Identifies a memory pool: 0 is the default pool, others are private pools
// (CUDA graph captures) created by begin_allocate_to_pool.
using pool_id = std::uint64_t;

enum class block_state { active_allocated, active_pending_free, inactive };
const char* to_string(block_state state);  // torch's spelling

struct block_info {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  block_state state = block_state::inactive;
  stream_handle stream = 0;
};

struct segment_info {
  int device = 0;
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  std::size_t requested_size = 0;
  stream_handle stream = 0;
  bool is_small = false;  // torch's segment_type "small" / "large"
  pool_id pool = 0;
  // An expandable segment appears as one entry per contiguous mapped run;
  // stitched: some of the run's chunks were moved there from a free hole.
  bool is_expandable = false;
  bool is_stitched = false;
  std::vector<block_info> blocks;  // in address order, covering the segment
};

struct allocator_snapshot {
  std::vector<segment_info> segments;  // in address order
};

}  // namespace streamalloc
