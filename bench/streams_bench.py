#!/usr/bin/env python3
"""The issue-5 benchmark (stream scheduling) on one GPU, in one process:

  - H2D throughput from PinnedPool memory vs torch pinned tensors
  - pageable H2D: streamalloc.to_device (staged) vs a direct tensor copy
  - a loop of (256 MiB H2D + 6 bf16 8192^3 matmuls) per step: Prefetcher vs
    a serial loop vs max(copy alone, compute alone)
  - cached PinnedPool allocation (+ free) time, in C++ and from Python
  - a fresh 256 MiB pinned buffer: touch + cudaHostRegister vs cudaHostAlloc
    vs torch.empty(pin_memory=True)

    python bench/streams_bench.py [--json FILE] [--quick]

Prints a markdown table (medians over repetitions) and writes the raw
numbers as JSON. The package must be importable (PYTHONPATH). Takes about
30 s on an H200; --quick only checks that everything runs. The loop is
timed over 48 steps (the first copy, which nothing can hide, included) and
reported per 8 steps, like the figures in shared/ANCHORS.md.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from streamalloc import streams

MiB = 1 << 20
BUFFER_BYTES = 256 * MiB
MATMUL_SIZE = 8192
MATMULS_PER_STEP = 6


def median(values):
    return statistics.median(values)


def timed(fn, reps):
    """Median wall seconds of fn(), the GPU drained before and after each run."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


def gpu_timed(fn, reps):
    """Median GPU seconds of the work fn() enqueues on the current stream."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def h2d_pinned(quick):
    copies, reps = (1, 2) if quick else (4, 7)
    device_buffer = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    torch_pinned = torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True).fill_(1)
    pool_pinned = streams.PinnedPool().empty(BUFFER_BYTES, torch.uint8).fill_(1)

    def copy_from(source):
        def run():
            for _ in range(copies):
                device_buffer.copy_(source, non_blocking=True)

        return run

    results = {"torch_pinned": [], "pool": []}
    copy_from(torch_pinned)()
    copy_from(pool_pinned)()
    for _ in range(reps):  # interleaved, so drift hits both alike
        results["torch_pinned"].append(copies * BUFFER_BYTES / gpu_timed(copy_from(torch_pinned), 1) / 1e9)
        results["pool"].append(copies * BUFFER_BYTES / gpu_timed(copy_from(pool_pinned), 1) / 1e9)
    return {name: median(values) for name, values in results.items()}


def h2d_pageable(quick):
    reps = 2 if quick else 5
    pageable = torch.empty(BUFFER_BYTES, dtype=torch.uint8).fill_(1)  # pages present, as a real batch's are
    device_buffer = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    streams.to_device(pageable)  # the staging ring and its threads start here
    direct = timed(lambda: device_buffer.copy_(pageable), reps)
    staged = timed(lambda: streams.to_device(pageable), reps)
    return {"direct_gbps": BUFFER_BYTES / direct / 1e9, "staged_gbps": BUFFER_BYTES / staged / 1e9}


def copy_compute_loop(quick):
    steps, reps = (4, 1) if quick else (48, 3)
    sources = [torch.full((BUFFER_BYTES,), i + 1, dtype=torch.uint8).pin_memory() for i in range(3)]
    batches = [sources[i % len(sources)] for i in range(steps)]
    weight = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device="cuda") / MATMUL_SIZE
    out = torch.empty(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device="cuda")
    resident = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda")

    def compute(batch):
        a = batch.view(torch.bfloat16)[: MATMUL_SIZE * MATMUL_SIZE].view(MATMUL_SIZE, MATMUL_SIZE)
        for _ in range(MATMULS_PER_STEP):
            torch.mm(a, weight, out=out)

    def compute_alone():
        for _ in batches:
            compute(resident)

    def copy_alone():
        for batch in batches:
            resident.copy_(batch, non_blocking=True)

    def serial():
        for batch in batches:
            compute(batch.to("cuda", non_blocking=True))

    def prefetched():
        for batch in streams.Prefetcher(batches, device="cuda", depth=2):
            compute(batch)

    for fn in (compute_alone, copy_alone, serial, prefetched):  # warm-up: cuBLAS, caches, streams
        timed(fn, 1)
    per_8_steps = 8 / steps
    result = {
        name: timed(fn, reps) * 1e3 * per_8_steps
        for name, fn in (("compute_ms", compute_alone), ("copy_ms", copy_alone), ("serial_ms", serial),
                         ("prefetcher_ms", prefetched))
    }
    result["steps_timed"] = steps
    return result


def cached_allocation(quick):
    iterations = 20_000 if quick else 200_000
    pool = streams.PinnedPool(capacity=1 << 30)
    sizes = (256, 64 << 10, 4 * MiB, 64 * MiB)
    cpp_ns = {size: pool._pool._time_cached_allocations(size, iterations) for size in sizes}
    python_iterations = 2_000 if quick else 20_000

    def python_pairs(make):
        make()  # cached from here on
        start = time.perf_counter()
        for _ in range(python_iterations):
            make()
        return (time.perf_counter() - start) / python_iterations * 1e6

    # The temporaries die at once, so each call is one allocation and one free.
    pool_us = python_pairs(lambda: pool.empty(64 << 10, torch.uint8))
    torch_us = python_pairs(lambda: torch.empty(64 << 10, dtype=torch.uint8, pin_memory=True))
    return {"cpp_ns": {str(k): v for k, v in cpp_ns.items()}, "python_pool_us": pool_us, "python_torch_us": torch_us}


def fresh_buffer(quick):
    reps = 1 if quick else 3
    result = {}
    for method in ("register", "host_alloc"):
        times = []
        for _ in range(reps):
            pool = streams.PinnedPool(pin_method=method)
            start = time.perf_counter()
            buffer = pool.empty(BUFFER_BYTES, torch.uint8)
            times.append(time.perf_counter() - start)
            del buffer
            torch.cuda.synchronize()
            pool.trim()
        result[f"{method}_ms"] = median(times) * 1e3
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    torch_reps = reps if empty_host_cache is not None else 1
    times = []
    for _ in range(torch_reps):
        if empty_host_cache is not None:
            empty_host_cache()
        start = time.perf_counter()
        buffer = torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
        times.append(time.perf_counter() - start)
        del buffer
    if empty_host_cache is not None:
        empty_host_cache()
    result["torch_pin_memory_ms"] = median(times) * 1e3
    return result


def verdict(ok):
    return "yes" if ok else "**no**"


def size_label(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B"


def table(r):
    pinned, pageable, loop, alloc, fresh = r["h2d_pinned"], r["h2d_pageable"], r["loop"], r["cached"], r["fresh"]
    bound = max(loop["copy_ms"], loop["compute_ms"])
    pinned_ratio = pinned["pool"] / pinned["torch_pinned"]
    staged_ratio = pageable["staged_gbps"] / pageable["direct_gbps"]
    loop_ratio = loop["prefetcher_ms"] / bound
    worst_ns = max(alloc["cpp_ns"].values())
    rows = [
        ("H2D from pinned, GB/s", f"PinnedPool {pinned['pool']:.1f}", f"torch pinned {pinned['torch_pinned']:.1f}",
         f"{pinned_ratio:.3f}x", ">= 0.95x", verdict(pinned_ratio >= 0.95)),
        ("H2D from pageable, GB/s", f"to_device (staged) {pageable['staged_gbps']:.1f}",
         f"direct copy {pageable['direct_gbps']:.1f}", f"{staged_ratio:.2f}x", ">= 25 GB/s and >= 3.4x",
         verdict(pageable["staged_gbps"] >= 25 and staged_ratio >= 3.4)),
        ("8 steps of 256 MiB H2D + 6 matmuls, ms", f"Prefetcher {loop['prefetcher_ms']:.1f}",
         f"max(copy {loop['copy_ms']:.1f}, compute {loop['compute_ms']:.1f}) = {bound:.1f}",
         f"{loop_ratio:.3f}x", "<= 1.03x", verdict(loop_ratio <= 1.03)),
        ("same loop, serial, ms", f"serial {loop['serial_ms']:.1f}", f"{bound:.1f}",
         f"{loop['serial_ms'] / bound:.3f}x", "(reported)", ""),
        ("cached PinnedPool allocate + free (C++), ns",
         ", ".join(f"{size_label(int(k))}: {v:.0f}" for k, v in alloc["cpp_ns"].items()),
         "", "", "<= 1000 ns", verdict(worst_ns <= 1000)),
        ("cached 64 KiB pinned tensor + free from Python, us", f"PinnedPool.empty {alloc['python_pool_us']:.2f}",
         f"torch.empty(pin_memory=True) {alloc['python_torch_us']:.2f}",
         f"{alloc['python_pool_us'] / alloc['python_torch_us']:.2f}x", "(reported)", ""),
        ("fresh 256 MiB pinned buffer, ms", f"touch + register {fresh['register_ms']:.1f}",
         f"cudaHostAlloc {fresh['host_alloc_ms']:.1f}, torch pin_memory {fresh['torch_pin_memory_ms']:.1f}",
         f"{fresh['register_ms'] / fresh['torch_pin_memory_ms']:.2f}x of torch", "faster than cudaHostAlloc",
         verdict(fresh["register_ms"] < min(fresh["host_alloc_ms"], fresh["torch_pin_memory_ms"]))),
    ]
    lines = [
        f"streams benchmark on {r['device']} (torch {r['torch']}); medians; loop figures per 8 steps "
        f"of {loop['steps_timed']} timed, first copy included",
        "",
        "| measurement | streamalloc | baseline | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks the script, not the numbers")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("streams_bench: torch sees no CUDA GPU")
    torch.cuda.init()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "quick": args.quick}
    started = time.perf_counter()
    results["h2d_pinned"] = h2d_pinned(args.quick)
    results["h2d_pageable"] = h2d_pageable(args.quick)
    results["loop"] = copy_compute_loop(args.quick)
    results["cached"] = cached_allocation(args.quick)
    results["fresh"] = fresh_buffer(args.quick)
    results["seconds"] = time.perf_counter() - started
    print(table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
