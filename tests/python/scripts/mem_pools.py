"""torch.cuda.MemPool under the allocator named by argv[1]: a pool with the
allocator's own memory, a pool whose segments come from a user allocator
(CUDAPluggableAllocator over tests' counting allocator library, path in
argv[2] or "" to skip), use counts, per-pool snapshots and empty_cache,
deleting a pool while its tensors live, and use_on_oom."""

import ctypes
import gc
import sys

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])
library = sys.argv[2] if len(sys.argv) > 2 else ""
torch.cuda.init()
MiB = 1 << 20
result = {}


def pool_segments(pool):
    return [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) == tuple(pool.id)]


# --- a pool of the allocator's own memory
pool = torch.cuda.MemPool()
result["id"] = list(pool.id)
result["use_count_new"] = pool.use_count()
with torch.cuda.use_mem_pool(pool):
    result["use_count_inside"] = pool.use_count()
    in_pool = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")
outside = torch.ones(3 * MiB, dtype=torch.uint8, device="cuda")
result["use_count_after"] = pool.use_count()
segments = pool_segments(pool)
result["pool_segment_count"] = len(segments)
result["tensor_in_pool"] = any(
    s["address"] <= in_pool.data_ptr() < s["address"] + s["total_size"] for s in segments
)
result["outside_in_pool"] = any(
    s["address"] <= outside.data_ptr() < s["address"] + s["total_size"] for s in segments
)
result["pool_snapshot_only_pool"] = all(
    tuple(s["segment_pool_id"]) == tuple(pool.id) for s in pool.snapshot()
)
result["pool_snapshot_count"] = len(pool.snapshot())
reserved_before = torch.cuda.memory_reserved()
del in_pool
torch.cuda.empty_cache()  # the whole cache, pools with users included
result["pool_segments_after_free_and_empty_cache"] = len(pool_segments(pool))
result["reserved_dropped"] = torch.cuda.memory_reserved() < reserved_before

# Deleting a pool while one of its tensors lives: the tensor stays valid.
pool2 = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool2):
    survivor = torch.full((MiB,), 7, dtype=torch.int32, device="cuda")
del pool2
gc.collect()
survivor += 1
result["survivor_ok"] = bool((survivor == 8).all().item())
del survivor
torch.cuda.synchronize()

# --- a pool with a user allocator
if library:
    counting = ctypes.CDLL(library)
    user = torch.cuda.memory.CUDAPluggableAllocator(library, "counting_alloc", "counting_free")
    user_pool = torch.cuda.MemPool(user.allocator())
    before = counting.counting_allocations()
    with torch.cuda.use_mem_pool(user_pool):
        a = torch.arange(5 * MiB, dtype=torch.int32, device="cuda")
        b = torch.ones(100, device="cuda")
    result["user_allocations"] = counting.counting_allocations() - before
    result["user_values_ok"] = bool(a[-1].item() == 5 * MiB - 1 and b.sum().item() == 100)
    frees_before = counting.counting_frees()
    del a, b
    del user_pool
    gc.collect()
    torch.cuda.synchronize()
    result["user_frees"] = counting.counting_frees() - frees_before
    result["user_live_bytes"] = counting.counting_live_bytes()

# --- use_on_oom: a capped default pool borrows the pool's cached memory
torch.cuda.empty_cache()
oom_pool = torch.cuda.MemPool(use_on_oom=True)
with torch.cuda.use_mem_pool(oom_pool):
    staged = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del staged  # its memory stays cached in oom_pool
total = torch.cuda.get_device_properties(0).total_memory
reserved = torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction(reserved / total)
try:
    borrowed = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    result["use_on_oom_served"] = True
    del borrowed
except torch.cuda.OutOfMemoryError as error:
    result["use_on_oom_served"] = False
    result["use_on_oom_error"] = str(error)[:300]
torch.cuda.set_per_process_memory_fraction(1.0)
emit(result)
