#!/usr/bin/env python3
"""Replays allocation traces (shared/traces/README.md format) through
PyTorch's own allocators on the GPU, each in its own process, and prints
their peak reserved memory over peak live bytes next to streamalloc's:

  native             torch's default caching allocator
  expandable         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cuda_async         PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  streamalloc        streamalloc-replay --backend cuda, default settings
                     (expandable segments and stitching)
  streamalloc_plain  the same with --conf expandable_segments:False (plain
                     cudaMalloc segments); both streamalloc columns need
                     --streamalloc-replay BIN
  recorded           what the native allocator reserved when the trace was
                     recorded (its segment_* events), no replay

    python bench/replay_torch.py --streamalloc-replay build-gpu/bin/streamalloc-replay \\
        --timeline-dir timelines --json replay.json TRACE...

A replay allocates through torch's caching-allocator entry point (what
torch.cuda.caching_allocator_alloc calls) on the trace's streams (0 = the
default stream, others become new torch.cuda.Stream()s) and frees at each
free_completed event. STREAMALLOC_CONF and torch's allocator variables are
removed from every replay's environment. --timeline-dir writes
NAME.MODE.csv (`op,allocated_bytes,reserved_bytes`) for
scripts/plot_replay.py. --time-limit bounds the whole run: replays that
would start after it are reported as not run.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import time

from _driver import TORCH_MODE_BACKEND, check_choices, mode_env, run_worker

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "scripts"))
import trace_csv  # noqa: E402  (scripts/, shared with capture_trace.py)

TORCH_MODES = ["native", "expandable", "cuda_async"]
# streamalloc-replay's --conf for each streamalloc column (None: defaults).
STREAMALLOC_MODES = {"streamalloc": None, "streamalloc_plain": "expandable_segments:False"}
COLUMNS = {
    "recorded": "native (recorded)",
    "native": "native",
    "expandable": "expandable_segments",
    "cuda_async": "cudaMallocAsync",
    "streamalloc": "streamalloc",
    "streamalloc_plain": "streamalloc plain",
}
# streamalloc-replay's counts of virtual-memory work (expandable segments),
# passed on where the binary reports them.
VMM_COUNTS = ("chunk_maps", "chunk_unmaps", "stitched_blocks", "stitch_syncs")
# The events a replay acts on; the others (free_requested, segment_*, oom,
# snapshot) only describe what the recording allocator did.
REPLAYED = ("alloc", "free_completed")
# What the driver reads: the replayed events and the recorded segments.
RECORDED = REPLAYED + ("segment_alloc", "segment_map", "segment_free", "segment_unmap")
# Timelines keep at most about this many rows from a Python replay: reading
# torch's stats costs tens of microseconds a call.
TIMELINE_SAMPLES = 20000


def trace_name(path):
    name = os.path.basename(path)
    for suffix in (".gz", ".csv", ".trace"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def read_trace(path, actions):
    """The trace's events whose action is in `actions`, as (action, addr,
    size, stream) tuples, with the allocations made before recording began
    put first, and the number of lines after the header. Lines of actions
    the format does not name are skipped with a warning; in a trace without
    free_completed lines, blocks are freed at their free_requested, with a
    warning."""
    try:
        events, lines, skipped = trace_csv.read_events(path, tuple(actions) + ("free_requested",))
    except trace_csv.TraceFormatError as e:
        raise SystemExit(f"replay_torch: {e}") from None
    if skipped:
        print(f"replay_torch: warning: {path}: skipped {trace_csv.describe_skipped(skipped)}", file=sys.stderr)
    events, converted = trace_csv.free_at_requests_without_completions(events)
    if converted:
        print(f"replay_torch: warning: {path}: no free_completed line; {converted} free_requested replayed as frees",
              file=sys.stderr)
    if "free_requested" not in actions:
        events = [e for e in events if e[0] != "free_requested"]
    return trace_csv.with_allocations_before_recording(events), lines


def trace_figures(events):
    """Peak live bytes, native's recorded peak reserved (0 without segment
    events), its reserved curve sampled at every alloc/free_completed, and
    what it reserved before recording began (trace_csv.native_figures)."""
    curve = []
    peak_live, peak_reserved, before = trace_csv.native_figures(events, curve)
    return peak_live, peak_reserved, curve, before


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
    expected = TORCH_MODE_BACKEND[mode]
    if backend != expected:
        raise SystemExit(f"replay_torch: mode {mode} expects allocator backend '{expected}', got '{backend}'")
    events, event_count = read_trace(trace, REPLAYED)

    streams = {0: torch.cuda.default_stream(0)}
    for _, _, _, handle in events:
        if handle not in streams:
            streams[handle] = torch.cuda.Stream(0)
    handles = {h: s.cuda_stream for h, s in streams.items()}
    # (allocation or free, trace address, size, CUDA stream), resolved before
    # the loop so that it does no per-event lookups it can avoid.
    ops = [(action == "alloc", addr, size, handles[handle]) for action, addr, size, handle in events]
    del events
    last = len(ops) - 1
    stride = max(1, len(ops) // TIMELINE_SAMPLES)
    torch.cuda.reset_peak_memory_stats(0)

    # torch.cuda.caching_allocator_alloc checks its arguments and switches to
    # the device around every call; device 0 is current throughout, so the
    # loop calls the entry points that it and caching_allocator_delete wrap.
    alloc = torch._C._cuda_cudaCachingAllocator_raw_alloc
    delete = torch._C._cuda_cudaCachingAllocator_raw_delete
    # torch.cuda.memory_reserved flattens and sorts every statistic on each
    # call; the timeline reads its one figure from the nested form.
    memory_stats = torch.cuda.memory_stats_as_nested_dict
    live = {}  # trace address -> (pointer, size)
    live_bytes = 0
    peak_live = 0
    rows = []
    start = time.perf_counter()
    for op, (is_alloc, addr, size, stream) in enumerate(ops):
        if is_alloc:
            # Size 0 gets no memory, as in torch.
            live[addr] = (alloc(size, stream) if size else 0, size)
            live_bytes += size
            if live_bytes > peak_live:
                peak_live = live_bytes
        else:
            ptr, size = live.pop(addr)
            if ptr:
                delete(ptr)
            live_bytes -= size
        if timeline_path and (op % stride == 0 or op == last):
            rows.append((op, live_bytes, memory_stats(0)["reserved_bytes"]["all"]["current"]))
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    result = {
        "mode": mode,
        "trace": trace,
        "allocator_backend": backend,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "events": event_count,
        "ops": len(ops),
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


def log(message):
    print(f"replay_torch: {message}", file=sys.stderr, flush=True)


def run_torch_mode(mode, trace, timeline, timeout):
    args = ["--timeline", timeline] if timeline else []
    return run_worker(__file__, mode, [*args, trace], timeout)


def run_streamalloc(column, binary, backend, trace, timeline, timeout):
    conf = STREAMALLOC_MODES[column]
    command = [binary, "--backend", backend, "--json"]
    if conf:
        command += ["--conf", conf]
    if timeline:
        command += ["--timeline", timeline]
    command.append(trace)
    error = None
    try:
        proc = subprocess.run(command, env=mode_env(column), stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            error = f"streamalloc-replay failed (exit status {proc.returncode})"
    except subprocess.TimeoutExpired:
        error = f"streamalloc-replay timed out after {timeout:.0f} s"
    except OSError as e:
        error = str(e)
    if error:
        # A half-written timeline would be plotted as if it were whole.
        if timeline and os.path.exists(timeline):
            os.remove(timeline)
        return {"mode": column, "error": error}
    r = json.loads(proc.stdout)
    return {
        "mode": column,
        "backend": backend,
        "conf": conf,
        "config": r["config"],
        "events": r["events"],
        "ops": r["ops"],
        "peak_live_bytes": r["trace_peak_live_bytes"],
        "peak_allocated_bytes": r["peak_allocated_bytes"],
        "peak_reserved_bytes": r["peak_reserved_bytes"],
        "segments": r["segments"],
        "ns_per_op": r["ns_per_op"],
        **{key: r[key] for key in VMM_COUNTS if key in r},
    }


def gib(n):
    return f"{n / 2**30:.3f}"


def missing_cell(m):
    return "not run" if m.get("not_run") else "failed"


def print_tables(results, columns, streamalloc_backend):
    print("## Trace replay: fragmentation (peak reserved / peak live bytes; 1.0 is the floor)")
    print()
    print(
        "Each allocator replays the same trace in its own process; torch's allocators through "
        "torch.cuda.caching_allocator_alloc/_delete, streamalloc through "
        f"`streamalloc-replay --backend {streamalloc_backend}`: \"streamalloc\" with its default settings "
        "(expandable segments and stitching), \"streamalloc plain\" with `--conf expandable_segments:False`. "
        "\"native (recorded)\" is what torch's native allocator reserved while the trace was recorded "
        "(\">=\": a lower bound, for a trace recorded mid-run)."
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
            bound = ">=" if m.get("lower_bound") else ""
            cells.append(f"{bound}{m['peak_reserved_bytes'] / r['peak_live_bytes']:.3f}" if "peak_reserved_bytes" in m
                         and r["peak_live_bytes"] else missing_cell(m))
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
                cells.append(missing_cell(m))
            elif m.get("lower_bound"):
                cells.append(">=" + gib(m["peak_reserved_bytes"]))
            elif "peak_allocated_bytes" in m:
                cells.append(f"{gib(m['peak_reserved_bytes'])} ({gib(m['peak_allocated_bytes'])})")
            else:
                cells.append(gib(m["peak_reserved_bytes"]))
        print(f"| {name} | {r['events']} | {gib(r['peak_live_bytes'])} | " + " | ".join(cells) + " |")
    vmm = {name: r["modes"]["streamalloc"] for name, r in results.items()
           if r["modes"].get("streamalloc", {}).get("chunk_maps")}
    if vmm:
        print()
        print("### streamalloc (default settings): segments and virtual-memory chunk work")
        print()
        print("| trace | segments | chunk maps | chunk unmaps | stitched blocks | stream syncs for stitching |")
        print("|---|---|---|---|---|---|")
        for name, m in vmm.items():
            print(f"| {name} | {m['segments']} | " + " | ".join(str(m[key]) for key in VMM_COUNTS) + " |")
    errors = [(name, c, m["error"]) for name, r in results.items() for c, m in r["modes"].items() if "error" in m]
    if errors:
        print()
        for name, c, error in errors:
            print(f"- {name} / {COLUMNS[c]}: {error}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", metavar="TRACE")
    parser.add_argument("--modes", default=",".join(TORCH_MODES),
                        help="torch allocators to replay through, comma-separated (empty: none)")
    parser.add_argument("--streamalloc-replay", metavar="BIN",
                        help="also replay through streamalloc with this binary (columns streamalloc, streamalloc_plain)")
    parser.add_argument("--streamalloc-backend", default="cuda", choices=["cuda", "sim"],
                        help="device of the streamalloc replay (default cuda)")
    parser.add_argument("--timeline-dir", help="write NAME.MODE.csv timelines here")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per replay process (default 180)")
    parser.add_argument("--time-limit", type=int, default=0,
                        help="seconds for the whole run (default 0: none): no replay starts after it, and each "
                             "one's timeout is cut to the time left")
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
    check_choices(parser, "mode", modes, TORCH_MODES)
    streamalloc_columns = list(STREAMALLOC_MODES) if args.streamalloc_replay else []
    columns = ["recorded", *modes, *streamalloc_columns]
    if args.timeline_dir:
        os.makedirs(args.timeline_dir, exist_ok=True)
    deadline = time.monotonic() + args.time_limit if args.time_limit > 0 else None

    def timeout_left():
        """--timeout, cut to what is left of --time-limit; None when
        nothing is left."""
        if deadline is None:
            return args.timeout
        left = deadline - time.monotonic()
        return min(args.timeout, left) if left > 0 else None

    results = {}
    for trace in args.traces:
        name = trace_name(trace)
        events, event_count = read_trace(trace, RECORDED)
        peak_live, recorded_peak, curve, before = trace_figures(events)
        del events
        entry = {"trace": trace, "events": event_count, "peak_live_bytes": peak_live, "modes": {}}
        entry["modes"]["recorded"] = (
            {"mode": "recorded", "peak_reserved_bytes": recorded_peak, "lower_bound": before > 0} if recorded_peak
            else {"mode": "recorded", "error": "the trace has no segment events"}
        )

        def timeline(column):
            return os.path.join(args.timeline_dir, f"{name}.{column}.csv") if args.timeline_dir else None

        if args.timeline_dir and recorded_peak:
            write_timeline(timeline("recorded"), [(i, a, r) for i, (a, r) in enumerate(curve)])
        del curve
        # streamalloc first: when --time-limit cuts the run short, the
        # allocator under test is the one measured.
        for column in [*streamalloc_columns, *modes]:
            timeout = timeout_left()
            if timeout is None:
                entry["modes"][column] = {"mode": column, "not_run": True,
                                          "error": f"not run: the {args.time_limit} s time limit was reached"}
            elif column in STREAMALLOC_MODES:
                log(f"{name}: replaying through {COLUMNS[column]} ({args.streamalloc_backend})")
                entry["modes"][column] = run_streamalloc(column, args.streamalloc_replay, args.streamalloc_backend,
                                                         trace, timeline(column), timeout)
            else:
                log(f"{name}: replaying through torch {column}")
                entry["modes"][column] = run_torch_mode(column, trace, timeline(column), timeout)
        entry["modes"] = {column: entry["modes"][column] for column in columns}
        results[name] = entry

    print_tables(results, columns, args.streamalloc_backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "replay_torch", "columns": columns, "results": results}, f, indent=1)
    failed = any("error" in m for r in results.values() for c, m in r["modes"].items() if c != "recorded")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
