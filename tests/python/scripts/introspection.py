"""Under streamalloc: allocates tensors of known sizes and reports torch's
and streamalloc's statistics, snapshots and summaries side by side, so the
tests can check they agree with each other and with the live tensors."""

import torch

import streamalloc
from _common import block_states, emit

streamalloc.install()
torch.cuda.init()

baseline = {"allocated": torch.cuda.memory_allocated(), "requested": streamalloc.stats()["requested_bytes.all.current"]}

# Multiples of 512 (no rounding), placed so that every block is split off
# exactly: small ones share 2 MiB segments, 3 MiB ones are carved from a
# 20 MiB segment with more than 1 MiB left over, 24 MiB gets its own.
KiB, MiB = 1 << 10, 1 << 20
sizes = [512, 4 * KiB, 64 * KiB, 1 * MiB, 3 * MiB, 3 * MiB, 12 * MiB, 24 * MiB]
tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
tensors.append(torch.empty((256, 1024), dtype=torch.float32, device="cuda"))
live_bytes = sum(t.untyped_storage().nbytes() for t in tensors)


def compare_stats():
    ours = streamalloc.stats()
    theirs = dict(torch.cuda.memory_stats())
    return {
        "torch_keys": sorted(theirs),
        "missing_in_streamalloc": sorted(k for k in theirs if k not in ours),
        "mismatches": {k: [theirs[k], ours[k]] for k in theirs if k in ours and ours[k] != theirs[k]},
        "fragmentation": {k: v for k, v in ours.items() if k.startswith("fragmentation.")},
        "torch": theirs,
    }


result = {"baseline": baseline, "live_bytes": live_bytes}
result["with_tensors"] = compare_stats()
result["memory_allocated"] = torch.cuda.memory_allocated()
result["memory_reserved"] = torch.cuda.memory_reserved()
result["backend"] = torch.cuda.memory.get_allocator_backend()

torch_snapshot = torch.cuda.memory._snapshot()
our_snapshot = streamalloc.snapshot()
states = block_states(torch_snapshot)
result["snapshot"] = {
    "has_device_traces": "device_traces" in torch_snapshot,
    "segment_bytes": sum(s["total_size"] for s in torch_snapshot["segments"]),
    "allocated_block_bytes": sum(
        b["size"] for s in torch_snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    ),
    "tensor_states": [states.get(t.data_ptr()) for t in tensors],
    "torch_segments": sorted((s["address"], s["total_size"]) for s in torch_snapshot["segments"]),
    "streamalloc_segments": sorted((s["address"], s["total_size"]) for s in our_snapshot["segments"]),
    "streamalloc_states": [block_states(our_snapshot).get(t.data_ptr()) for t in tensors],
}

# Free some tensors: allocated drops by their sizes, the peak stays.
peak_before = torch.cuda.max_memory_allocated()
freed = tensors[4:7]
freed_bytes = sum(t.untyped_storage().nbytes() for t in freed)
del tensors[4:7], freed
result["after_free"] = {
    "freed_bytes": freed_bytes,
    "allocated": torch.cuda.memory_allocated(),
    "peak": torch.cuda.max_memory_allocated(),
    "peak_before": peak_before,
}
torch.cuda.reset_peak_memory_stats()
result["after_reset_peak"] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
torch.cuda.reset_accumulated_memory_stats()
result["after_reset_accumulated"] = {
    "torch_allocated_total": torch.cuda.memory_stats()["allocated_bytes.all.allocated"],
    "streamalloc_allocated_total": streamalloc.stats()["allocated_bytes.all.allocated"],
}

# The raw pointer interface (thrust, caching_allocator_alloc) goes through
# raw_alloc / raw_delete.
before = torch.cuda.memory_allocated()
pointer = torch.cuda.caching_allocator_alloc(MiB)
during = torch.cuda.memory_allocated()
torch.cuda.caching_allocator_delete(pointer)
result["raw"] = {"before": before, "during": during, "after": torch.cuda.memory_allocated()}

# Empty tensors ask for no memory: a null pointer, no block, and a
# record_stream and a free that change nothing.
allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
empties = [torch.empty(0, device="cuda"), torch.empty((0, 5), device="cuda"), torch.zeros(0, device="cuda")]
side = torch.cuda.Stream()
for t in empties:
    t.record_stream(side)
result["empty_tensors"] = {
    "data_ptrs": [t.data_ptr() for t in empties],
    "shapes": [list(t.shape) for t in empties],
    "devices": [str(t.device) for t in empties],
}
del empties, t
torch.cuda.synchronize()
result["empty_tensors"]["new_allocations"] = torch.cuda.memory_stats()["allocation.all.allocated"] - allocations

result["summary"] = {"torch": torch.cuda.memory_summary(), "streamalloc": streamalloc.memory_summary()}
result["after_free_stats"] = compare_stats()
emit(result)
