#!/usr/bin/env python3
"""Replays allocation traces (shared/traces/README.md format) through
PyTorch's own allocators on the GPU, each in its own process, and prints
their peak reserved memory over peak live bytes next to streamalloc's:

  native        torch's default caching allocator
  expandable    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cuda_async    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  streamalloc   build/bin/streamalloc-replay --backend cuda (with
                --streamalloc-replay BIN)
  recorded      what the native allocator reserved when the trace was
                recorded (its segment_* events), no replay

    python bench/replay_torch.py --streamalloc-replay build-gpu/bin/streamalloc-replay \\
        --timeline-dir timelines --json replay.json TRACE...

A replay allocates with torch.cuda.caching_allocator_alloc on the trace's
streams (0 = the default stream, others become new torch.cuda.Stream()s)
and frees with caching_allocator_delete at each free_completed event.
--timeline-dir writes NAME.MODE.csv (`op,allocated_bytes,reserved_bytes`)
for scripts/plot_replay.py.
"""

import argparse
import csv
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

TORCH_MODES = ["native", "expandable", "cuda_async"]
MODE_CONF = {"expandable": "expandable_segments:True", "cuda_async": "backend:cudaMallocAsync"}
COLUMNS = {
    "recorded": "native (recorded)",
    "native": "native",
    "expandable": "expandable_segments",
    "cuda_async": "cudaMallocAsync",
    "streamalloc": "streamalloc",
}
# Timelines keep at most about this many rows from a Python replay: reading
# torch's stats costs tens of microseconds a call.
TIMELINE_SAMPLES = 20000


def trace_name(path):
    name = os.path.basename(path)
    for suffix in (".gz", ".csv", ".trace"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def read_trace(path):
    """The trace's events as (action, addr, size, stream) tuples."""
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["action", "addr", "size", "stream"]:
            raise SystemExit(f"replay_torch: {path}: header {header} is not action,addr,size,stream")
        return [(row[0], int(row[1]), int(row[2]), int(row[3])) for row in reader]


def trace_figures(events):
    """Peak live bytes, and the native allocator's recorded reserved curve
    sampled at every alloc/free_completed op."""
    live = {}
    live_bytes = peak_live = reserved = peak_reserved = 0
    curve = []
    for action, addr, size, _ in events:
        if action == "alloc":
            live[addr] = size
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
            curve.append((live_bytes, reserved))
        elif action == "free_completed":
            live_bytes -= live.pop(addr)
            curve.append((live_bytes, reserved))
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    return peak_live, peak_reserved, curve


def write_timeline(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["op", "allocated_bytes", "reserved_bytes"])
        writer.writerows(rows)


# ---------------------------------------------------------------- worker


def worker(mode, trace, out_path, timeline_path):
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("replay_torch: torch sees no CUDA device")
    torch.cuda.init()
    backend = torch.cuda.get_allocator_backend()
    expected = "cudaMallocAsync" if mode == "cuda_async" else "native"
    if backend != expected:
        raise SystemExit(f"replay_torch: mode {mode} expects allocator backend '{expected}', got '{backend}'")
    events = read_trace(trace)
    ops_total = sum(1 for e in events if e[0] in ("alloc", "free_completed"))
    stride = max(1, ops_total // TIMELINE_SAMPLES)

    streams = {0: torch.cuda.default_stream(0)}
    for _, _, _, handle in events:
        if handle not in streams:
            streams[handle] = torch.cuda.Stream(0)
    handles = {h: s.cuda_stream for h, s in streams.items()}
    torch.cuda.reset_peak_memory_stats(0)

    alloc = torch.cuda.caching_allocator_alloc
    delete = torch.cuda.caching_allocator_delete
    live = {}  # trace address -> (pointer, size)
    live_bytes = 0
    peak_live = 0
    op = 0
    rows = []
    start = time.perf_counter()
    for action, addr, size, handle in events:
        if action == "alloc":
            # Size 0 gets no memory, as in torch.
            live[addr] = (alloc(size, 0, handles[handle]) if size else 0, size)
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
        elif action == "free_completed":
            ptr, size = live.pop(addr)
            if ptr:
                delete(ptr)
            live_bytes -= size
        else:
            continue
        if timeline_path and (op % stride == 0 or op == ops_total - 1):
            rows.append((op, live_bytes, torch.cuda.memory_reserved(0)))
        op += 1
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    result = {
        "mode": mode,
        "trace": trace,
        "allocator_backend": backend,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "events": len(events),
        "ops": op,
        "live_at_end": len(live),
        "peak_live_bytes": peak_live,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(0),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(0),
        "replay_seconds": round(seconds, 3),
    }
    for ptr, _ in live.values():
        if ptr:
            delete(ptr)
    if timeline_path:
        write_timeline(timeline_path, rows)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


# ---------------------------------------------------------------- driver


def worker_env(mode):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if mode in MODE_CONF:
        env["PYTORCH_CUDA_ALLOC_CONF"] = MODE_CONF[mode]
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log(message):
    print(f"replay_torch: {message}", file=sys.stderr, flush=True)


def run_torch_mode(mode, trace, timeline, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out_path]
        if timeline:
            command += ["--timeline", timeline]
        command.append(trace)
        try:
            proc = subprocess.run(command, env=worker_env(mode), stdout=sys.stderr, timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout} s"
        if status == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        return {"mode": mode, "error": f"worker failed (exit status {status})"}


def run_streamalloc(binary, backend, trace, timeline, timeout):
    command = [binary, "--backend", backend, "--json"]
    if timeline:
        command += ["--timeline", timeline]
    command.append(trace)
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"mode": "streamalloc", "error": str(error)}
    if proc.returncode != 0:
        return {"mode": "streamalloc", "error": f"streamalloc-replay failed (exit status {proc.returncode})"}
    r = json.loads(proc.stdout)
    return {
        "mode": "streamalloc",
        "backend": backend,
        "config": r["config"],
        "events": r["events"],
        "ops": r["ops"],
        "peak_live_bytes": r["trace_peak_live_bytes"],
        "peak_allocated_bytes": r["peak_allocated_bytes"],
        "peak_reserved_bytes": r["peak_reserved_bytes"],
        "segments": r["segments"],
        "ns_per_op": r["ns_per_op"],
    }


def gib(n):
    return f"{n / 2**30:.3f}"


def print_tables(results, columns, streamalloc_backend):
    print("## Trace replay: fragmentation (peak reserved / peak live bytes; 1.0 is the floor)")
    print()
    print(
        "Each allocator replays the same trace in its own process; torch's allocators through "
        "torch.cuda.caching_allocator_alloc/_delete, streamalloc through "
        f"`streamalloc-replay --backend {streamalloc_backend}`. \"native (recorded)\" is what torch's native allocator "
        "reserved while the trace was recorded."
    )
    print()
    header = "| trace | events | peak live GiB | " + " | ".join(COLUMNS[c] for c in columns) + " |"
    rule = "|---|---|---|" + "---|" * len(columns)
    print(header)
    print(rule)
    for name, r in results.items():
        cells = []
        for c in columns:
            m = r["modes"].get(c, {})
            cells.append(f"{m['peak_reserved_bytes'] / r['peak_live_bytes']:.3f}" if "peak_reserved_bytes" in m
                         and r["peak_live_bytes"] else "failed")
        print(f"| {name} | {r['events']} | {gib(r['peak_live_bytes'])} | " + " | ".join(cells) + " |")
    print()
    print("### Peak reserved GiB (peak allocated GiB as the allocator counts it)")
    print()
    print(header)
    print(rule)
    for name, r in results.items():
        cells = []
        for c in columns:
            m = r["modes"].get(c, {})
            if "peak_reserved_bytes" not in m:
                cells.append("failed")
            elif "peak_allocated_bytes" in m:
                cells.append(f"{gib(m['peak_reserved_bytes'])} ({gib(m['peak_allocated_bytes'])})")
            else:
                cells.append(gib(m["peak_reserved_bytes"]))
        print(f"| {name} | {r['events']} | {gib(r['peak_live_bytes'])} | " + " | ".join(cells) + " |")
    errors = [(name, c, m["error"]) for name, r in results.items() for c, m in r["modes"].items() if "error" in m]
    if errors:
        print()
        for name, c, error in errors:
            print(f"- {name} / {c}: {error}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", metavar="TRACE")
    parser.add_argument("--modes", default=",".join(TORCH_MODES),
                        help="torch allocators to replay through, comma-separated (empty: none)")
    parser.add_argument("--streamalloc-replay", metavar="BIN", help="also replay through streamalloc with this binary")
    parser.add_argument("--streamalloc-backend", default="cuda", choices=["cuda", "sim"],
                        help="device of the streamalloc replay (default cuda)")
    parser.add_argument("--timeline-dir", help="write NAME.MODE.csv timelines here")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per replay process (default 180)")
    parser.add_argument("--worker", choices=TORCH_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--timeline", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        if len(args.traces) != 1:
            parser.error("a worker replays one trace")
        worker(args.worker, args.traces[0], args.out, args.timeline)
        return 0

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in TORCH_MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(TORCH_MODES)}")
    columns = ["recorded", *modes] + (["streamalloc"] if args.streamalloc_replay else [])
    if args.timeline_dir:
        os.makedirs(args.timeline_dir, exist_ok=True)

    results = {}
    for trace in args.traces:
        name = trace_name(trace)
        events = read_trace(trace)
        peak_live, recorded_peak, curve = trace_figures(events)
        entry = {"trace": trace, "events": len(events), "peak_live_bytes": peak_live, "modes": {}}
        entry["modes"]["recorded"] = (
            {"mode": "recorded", "peak_reserved_bytes": recorded_peak} if recorded_peak
            else {"mode": "recorded", "error": "the trace has no segment events"}
        )

        def timeline(column):
            return os.path.join(args.timeline_dir, f"{name}.{column}.csv") if args.timeline_dir else None

        if args.timeline_dir and recorded_peak:
            write_timeline(timeline("recorded"), [(i, a, r) for i, (a, r) in enumerate(curve)])
        for mode in modes:
            log(f"{name}: replaying through torch {mode}")
            entry["modes"][mode] = run_torch_mode(mode, trace, timeline(mode), args.timeout)
        if args.streamalloc_replay:
            log(f"{name}: replaying through streamalloc ({args.streamalloc_backend})")
            entry["modes"]["streamalloc"] = run_streamalloc(
                args.streamalloc_replay, args.streamalloc_backend, trace, timeline("streamalloc"), args.timeout)
        results[name] = entry

    print_tables(results, columns, args.streamalloc_backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "replay_torch", "columns": columns, "results": results}, f, indent=1)
    failed = any("error" in m for r in results.values() for c, m in r["modes"].items() if c != "recorded")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
