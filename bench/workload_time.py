#!/usr/bin/env python3
"""Whole-workload time: runs trace-corpus workloads (bench/workloads, as
scripts/capture_corpus.sh names them) from start to end under each
allocator, every run in its own process, and prints the wall time of the
workload (model built, every step or request run, the GPU synchronized),
its peak memory and, for streamalloc, the device calls and stream
synchronizations it made:

  native       torch's default caching allocator
  expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cuda_async   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  streamalloc  `import streamalloc; streamalloc.install()` first, defaults

    python bench/workload_time.py [--workloads fsdp2_streams4,inference_server]
        [--modes native,streamalloc] [--rounds 2] [--json FILE]

--smoke runs each workload on the CPU with a tiny model (`--device cpu
--tiny --steps 2`, native mode only): a check of this script without a GPU.

Unlike bench/python_bench.py, whose steps repeat one shape, these
workloads change shapes every step and use side streams, so streamalloc's
slow path (growth, stitching and the stream synchronizations stitching
makes) runs while they are timed. The modes of each round run in a
rotated order; a round's figure is one process's time, so the spread
between rounds is the noise to read the differences against.
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import time

from _driver import enter_mode, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ["native", "expandable", "cuda_async", "streamalloc"]
DEFAULT_WORKLOADS = ["fsdp2_streams4", "inference_server", "bert_serve_inflight8", "hf_generate_dynamic",
                     "hf_llama_train_varlen"]
# streamalloc's counters of slow-path work, reported per run.
COUNTERS = ("num_device_alloc", "num_device_free", "vmm.num_chunk_maps", "vmm.num_chunk_unmaps", "vmm.num_stitched_blocks",
            "vmm.num_stitch_syncs", "num_sync_all_streams", "num_alloc_retries")


def log(message):
    print(f"workload_time: {message}", file=sys.stderr, flush=True)


def corpus():
    """{trace name: (script path, arguments)} from capture_corpus.sh --list."""
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "capture_corpus.sh"), "--list"],
                         capture_output=True, text=True, check=True)
    entries = {}
    for line in out.stdout.splitlines():
        name, script, *args = line.split()
        entries[name] = (os.path.join(REPO, script), args)
    return entries


# ---------------------------------------------------------------- worker


def worker(mode, out_path, script, script_args, smoke):
    if smoke:
        sys.argv = [script, *script_args]
        start = time.perf_counter()
        runpy.run_path(script, run_name="__main__")
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "seconds": time.perf_counter() - start, "peak_allocated": 0, "peak_reserved": 0}, f)
        return
    torch = enter_mode(mode, "workload_time")
    torch.cuda.synchronize()
    sys.argv = [script, *script_args]
    start = time.perf_counter()
    runpy.run_path(script, run_name="__main__")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "mode": mode,
        "seconds": seconds,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }
    if mode == "streamalloc":
        stats = sys.modules["streamalloc"].stats()
        result["counters"] = {name: stats.get(name, 0) for name in COUNTERS}
    with open(out_path, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- driver


def main():
    # No abbreviations: a workload's own options pass through to its script.
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="corpus trace names")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="one run's limit in seconds")
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="tiny CPU runs, native mode only (no GPU needed)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--script", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.worker:
        worker(args.worker, args.out, args.script, rest, args.smoke)
        return 0

    modes = ["native"] if args.smoke else args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    entries = corpus()
    names = args.workloads.split(",")
    missing = [n for n in names if n not in entries]
    if missing:
        p.error(f"not in the corpus: {missing} (scripts/capture_corpus.sh --list names them)")
    runs = {name: {mode: [] for mode in modes} for name in names}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for name in names:
            script, script_args = entries[name]
            for mode in order:
                log(f"round {r + 1}/{args.rounds}: {name} under {mode}")
                smoke = ["--smoke", "--device", "cpu", "--tiny", "--steps", "2"] if args.smoke else []
                result = run_worker(__file__, mode, ["--script", script, *smoke[:1], *script_args, *smoke[1:]],
                                    args.timeout)
                runs[name][mode].append(result)
                if args.json:  # after every run, so that a cut-off run keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(runs, f, indent=1)

    print("### Whole-workload time, seconds per round (peak reserved / peak allocated GiB)\n")
    print("| workload | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for name in names:
        cells = []
        for mode in modes:
            done = [x for x in runs[name][mode] if "error" not in x]
            if not done:
                cells.append(runs[name][mode][0]["error"] if runs[name][mode] else "not run")
                continue
            times = ", ".join(f"{x['seconds']:.2f}" for x in done)
            peak = max(done, key=lambda x: x["peak_reserved"])
            cells.append(f"{times} ({peak['peak_reserved'] / 2**30:.2f} / {peak['peak_allocated'] / 2**30:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "streamalloc" in modes:
        print("\nstreamalloc's slow-path work per run (" + ", ".join(COUNTERS) + "):\n")
        for name in names:
            counts = [x["counters"] for x in runs[name]["streamalloc"] if "counters" in x]
            text = "; ".join(", ".join(str(c[k]) for k in COUNTERS) for c in counts) or "none"
            print(f"- {name}: {text}")
    failed = any("error" in x for per in runs.values() for xs in per.values() for x in xs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
