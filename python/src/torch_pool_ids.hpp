// Note [pool ids]
// torch names a private pool by a pair with exactly one non-zero side:
// .first for a pool made by a capture, .second for graph_pool_handle() and
// torch.cuda.MemPool. Both sides are counters, so they fit in 63 bits and
// the top bit of a streamalloc pool_id records the side. The mapping needs
// no table, and a snapshot can name each segment's pool the way torch does.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

#include "streamalloc/core/snapshot.hpp"

namespace streamalloc {

// Throws c10::Error for a pair torch never makes (both sides set, or a
// counter using the top bit). {0, 0} is the default pool, 0.
pool_id to_pool_id(c10::MempoolId_t id);
c10::MempoolId_t to_mempool_id(pool_id id);

}  // namespace streamalloc
