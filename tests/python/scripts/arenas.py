"""torch's memory API while streamalloc serves threads from several arenas.
Helper threads move to arenas 1 and 2 (as sustained contention would move
them) and allocate there; the main thread stays on arena 0 and frees what
they allocated. Measured: torch's statistics and snapshot against the live
tensors, the peak of the sum, a record_stream free from another arena, a
CUDA graph and a MemPool on arena 1, the memory fraction and out of memory
across arenas, the memory history and empty_cache."""

import threading

import torch

import streamalloc
from _common import emit

streamalloc.install(arenas=4)  # the default, whatever STREAMALLOC_CONF says
torch.cuda.init()
DEVICE = torch.cuda.current_device()
MiB = 1 << 20
result = {}


def on_arena(index, work, *args):
    """work(*args) in a new thread moved to arena `index`; its result, or
    its exception raised here."""
    out = {}

    def run():
        try:
            streamalloc._C._use_arena(index, DEVICE)
            out["value"] = work(*args)
        except BaseException as error:  # re-raised in the caller
            out["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def filled(nbytes, value):
    return torch.full((nbytes // 4,), float(value), device="cuda")


def live_blocks(snapshot):
    """Address -> (size, pool id) of every allocated block."""
    blocks = {}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[address] = (block["size"], tuple(segment["segment_pool_id"]))
            address += block["size"]
    return blocks


streamalloc._C._use_arena(0, DEVICE)  # the main thread, whatever arena it would start on
torch.cuda.synchronize()
torch.cuda.empty_cache()
result["reserved_at_start"] = torch.cuda.memory_reserved()
baseline = torch.cuda.memory_allocated()

# --- statistics and snapshot over three arenas --------------------------------
sizes = {1: [4096, 3 * MiB, 40 * MiB], 2: [5 * MiB]}
tensors = []
for arena, arena_sizes in sizes.items():
    tensors += on_arena(arena, lambda s, a: [filled(n, a * 100 + i) for i, n in enumerate(s)], arena_sizes, arena)
tensors.append(filled(2 * MiB, 7))
torch.cuda.synchronize()
expected_values = [100, 101, 102, 200, 7]
stats = torch.cuda.memory_stats()
ours = streamalloc.stats(DEVICE)
snapshot = torch.cuda.memory._snapshot()
blocks = live_blocks(snapshot)
result["stats"] = {
    "arenas": streamalloc._C._arena_count(DEVICE),
    "live_bytes": sum(t.numel() * 4 for t in tensors),
    "allocated": stats["allocated_bytes.all.current"] - baseline,
    "mismatched_keys": sorted(k for k, v in stats.items() if isinstance(v, int) and ours.get(k) != v),
    "reserved": stats["reserved_bytes.all.current"],
    "snapshot_reserved": sum(s["total_size"] for s in snapshot["segments"]),
    "snapshot_allocated": sum(s["allocated_size"] for s in snapshot["segments"]),
    "allocated_total": stats["allocated_bytes.all.current"],
    "tensors_in_snapshot": [t.data_ptr() in blocks for t in tensors],
    "segments": [
        [s["address"], s["total_size"], s["allocated_size"], s["segment_type"], s["is_expandable"]]
        for s in snapshot["segments"]
    ],
    "reserved_by_pool": {k: v for k, v in stats.items() if k.startswith("reserved_bytes.") and k.endswith(".current")},
    # Last: the comparisons allocate temporaries of their own.
    "values_ok": [bool((t == v).all()) for t, v in zip(tensors, expected_values)],
}

# --- the peak of the sum, and frees from arena 0 ------------------------------
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
on_arena(1, lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda").data_ptr())  # and freed there
kept = on_arena(2, filled, 32 * MiB, 2)
result["peak"] = {
    "before": before,
    "peak": torch.cuda.max_memory_allocated(),
    "expected_peak": before + 64 * MiB,
    "after": torch.cuda.memory_allocated(),
    "expected_after": before + 32 * MiB,
}
del kept
tensors.clear()
torch.cuda.synchronize()
result["peak"]["allocated_after_frees"] = torch.cuda.memory_allocated() - baseline

# --- record_stream: freed from arena 0, reused on arena 1 ---------------------
side = torch.cuda.Stream()
numel = 4 * MiB


def use_on_side_stream():
    t = torch.ones(numel, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the free must wait for this stream
        total = t.sum()
    t.record_stream(side)
    return t, total


shared, total = on_arena(1, use_on_side_stream)
del shared  # the free reaches arena 1 from this thread
reused = on_arena(1, lambda: torch.full((numel,), 7.0, device="cuda"))
torch.cuda.synchronize()
result["record_stream"] = {"sum": total.item(), "expected": float(numel)}
del reused, total

# --- a CUDA graph captured on arena 1 -----------------------------------------


def capture_and_replay():
    x = torch.ones(MiB, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        x * 2 + 1
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    graph.replay()
    first = y[0].item()
    x.fill_(5)
    graph.replay()
    torch.cuda.synchronize()
    pools = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory._snapshot()["segments"]}
    return {"first": first, "second": y[0].item(), "all_equal": bool((y == 11).all()), "pool_ids": sorted(pools)}


result["graph"] = on_arena(1, capture_and_replay)

# --- a MemPool used on arena 2 --------------------------------------------------


def fill_pool():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = filled(8 * MiB, 3)
    blocks = live_blocks(torch.cuda.memory._snapshot())
    out = {
        "pool_id": list(pool.id),
        "block_pool": list(blocks.get(t.data_ptr(), (0, (0, 0)))[1]),
        "pool_segments": len(pool.snapshot()),
        "value_ok": bool((t == 3).all()),
    }
    del t, pool
    return out


result["mempool"] = on_arena(2, fill_pool)
torch.cuda.synchronize()
torch.cuda.empty_cache()
result["after_graph_and_pool"] = {
    "reserved": torch.cuda.memory_reserved(),
    "allocated": torch.cuda.memory_allocated() - baseline,
}

# --- the memory fraction and out of memory across arenas ---------------------
total_memory = torch.cuda.get_device_properties(DEVICE).total_memory
cached = torch.empty(int(0.03 * total_memory), dtype=torch.uint8, device="cuda")
del cached  # cached on arena 0
torch.cuda.set_per_process_memory_fraction(0.05)


def try_allocate(fraction):
    try:
        t = torch.empty(int(fraction * total_memory), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as error:
        return {"ok": False, "message": str(error)}
    reserved = torch.cuda.memory_reserved()
    del t
    return {"ok": True, "reserved": reserved}


result["fraction"] = {
    "total": total_memory,
    "fits_after_release": on_arena(1, try_allocate, 0.04),
    "too_large": on_arena(1, try_allocate, 0.06),
    "num_ooms": torch.cuda.memory_stats()["num_ooms"],
}
torch.cuda.set_per_process_memory_fraction(1.0)

# --- memory history from arena 1 ------------------------------------------------
torch.cuda.memory._record_memory_history(max_entries=10000)


def allocate_and_free():
    t = filled(6 * MiB, 1)
    address = t.data_ptr()
    del t
    return address


address = on_arena(1, allocate_and_free)
traces = torch.cuda.memory._snapshot()["device_traces"][DEVICE]
result["history"] = [t["action"] for t in traces if t["addr"] == address and not t["action"].startswith("segment_")]
torch.cuda.memory._record_memory_history(enabled=None)

torch.cuda.synchronize()
torch.cuda.empty_cache()
result["end"] = {
    "reserved": torch.cuda.memory_reserved(),
    "allocated": torch.cuda.memory_allocated() - baseline,
    "segments": len(torch.cuda.memory._snapshot()["segments"]),
    "arenas": streamalloc._C._arena_count(DEVICE),
}
emit(result)
