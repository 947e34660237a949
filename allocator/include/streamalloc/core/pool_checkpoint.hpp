// The block layout of one private pool, taken and restored by CUDA graph
// trees (torch.compile "reduce-overhead"): after replaying a graph the pool
// is put back to the layout the graph's recording left, so the tensors the
// graph produced live at the addresses it wrote to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/snapshot.hpp"

namespace streamalloc {

struct pool_checkpoint {
  struct block_state {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::size_t requested_size = 0;  // 0 while free
    stream_handle stream = 0;
    bool allocated = false;
    bool mapped = true;  // false: an unmapped stretch of an expandable segment
  };
  struct segment_state {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    bool is_small = false;
    std::vector<block_state> blocks;  // address order, tiling the segment
  };
  pool_id pool = 0;
  std::vector<segment_state> segments;  // address order
};

// What restoring a checkpoint changed: the allocations it ended (live
// before, no longer owned by their callers) and the ones it created (now
// owned by the caller of restore_pool). A pointer may be in both.
struct pool_restore_result {
  std::vector<void*> freed;
  std::vector<void*> allocated;
};

}  // namespace streamalloc
