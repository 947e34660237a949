#!/usr/bin/env python3
"""Records the CUDA allocation trace of a PyTorch program in the trace format
of shared/traces/README.md (gzip'd CSV `action,addr,size,stream`), for
streamalloc-replay and bench/replay_torch.py.

    python scripts/capture_trace.py -o out.trace.csv.gz -- prog.py [args...]
        runs prog.py in this process under
        torch.cuda.memory._record_memory_history(enabled="all", context=None)
        (torch's native allocator must be in use: leave
        PYTORCH_CUDA_ALLOC_CONF's backend alone) and writes
        torch.cuda.memory._snapshot()["device_traces"][device]; a program
        that exits non-zero or raises (out of memory, say) still leaves the
        trace recorded until then, and its status is this tool's
    python scripts/capture_trace.py -o out.trace.csv.gz --from-pickle snap.pickle
        converts a pickle written by torch.cuda.memory._dump_snapshot

The output is gzip'd when its name ends in .gz.

A snapshot taken after recording began mid-run (_record_memory_history
called after a model was loaded, or a ring of max_entries that overwrote
the oldest events) lacks the allocs of blocks that were live before. The
blocks the snapshot still holds and the trace never names are written as
alloc events at the start of the file. Blocks the trace frees without an
alloc are left as recorded: streamalloc-replay and replay_torch.py replay
them as allocated before the first event.
"""

import argparse
import csv
import os
import pickle
import runpy
import sys
import traceback

import _streamalloc_version  # the checkout's version (CMakeLists.txt)
import trace_csv


def blocks(count):
    return f"{count} block" + ("" if count == 1 else "s")


def replayed_addresses(entries):
    """The addresses an alloc or free_completed of `entries` names."""
    return {int(e.get("addr", 0)) for e in entries if e["action"] in ("alloc", "free_completed")}


def live_before_recording(snapshot, device, entries):
    """Alloc entries for the blocks `snapshot` holds on `device` (allocated,
    or freed and waiting for their streams) whose address `entries` never
    names: they were allocated before recording began and stayed live."""
    named = replayed_addresses(entries)
    allocs = []
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            address = int(block["address"])
            if block.get("state") in ("active_allocated", "active_pending_free") and address not in named:
                allocs.append({"action": "alloc", "addr": address, "size": int(block["size"]),
                               "stream": int(segment.get("stream", 0))})
    return allocs


def as_events(entries):
    """(action, addr, size, stream) of each of `entries` (torch TraceEntry
    dicts); an oom entry carries device_free instead of an address."""
    return [(e["action"], int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0))) for e in entries]


def write_trace(events, path):
    """Writes `events` to `path`; returns the count of each action."""
    counts = {}
    with trace_csv.open_for_writing(path) as out:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(trace_csv.COLUMNS)
        writer.writerows(events)
    for event in events:
        counts[event[0]] = counts.get(event[0], 0) + 1
    return counts


def summarize(path, counts, peak_live, peak_reserved):
    unknown = sorted(set(counts) - trace_csv.KNOWN_ACTIONS)
    parts = ", ".join(f"{counts[a]} {a}" for a in sorted(counts))
    ratio = f"{peak_reserved / peak_live:.3f}" if peak_live else "n/a"
    print(
        f"capture_trace: wrote {path}: {sum(counts.values())} events ({parts}); peak live "
        f"{peak_live:,} B, native peak reserved {peak_reserved:,} B (ratio {ratio})",
        file=sys.stderr,
    )
    if unknown:
        print(f"capture_trace: note: actions this tool does not know: {', '.join(unknown)}", file=sys.stderr)


def device_trace(snapshot, device, source):
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        sys.exit(f"capture_trace: {source} has traces for {len(traces)} device(s); no device {device}")
    entries = traces[device]
    if not entries:
        sys.exit(
            f"capture_trace: {source} holds no trace entries for device {device} "
            "(was _record_memory_history(enabled='all') on, and did the program allocate on that device?)"
        )
    return entries


def run_program(argv, max_entries):
    """Runs the Python program `argv` as __main__ under memory-history
    recording and returns the snapshot taken when it ends."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("capture_trace: torch sees no CUDA device")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        sys.exit(f"capture_trace: torch's allocator backend is '{backend}'; traces come from the native allocator")
    program = argv[0]
    if not os.path.isfile(program):
        sys.exit(f"capture_trace: no such program: {program}")
    # Tracebacks are not recorded (context=None): the trace needs only the
    # actions, and stack capture would slow the program down.
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=max_entries)
    saved_argv, saved_path0 = sys.argv, sys.path[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    status = 0
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception:  # noqa: BLE001  (a program that fails, out of memory say, still leaves its trace)
        traceback.print_exc()
        status = 1
    finally:
        sys.argv = saved_argv
        sys.path[0] = saved_path0
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if status != 0:
        print(f"capture_trace: {program} ended with status {status}; writing the trace so far", file=sys.stderr)
    return snapshot, status


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="trace file to write (.csv or .csv.gz)")
    parser.add_argument("--from-pickle", metavar="SNAPSHOT", help="convert a _dump_snapshot pickle instead of running")
    parser.add_argument("--device", type=int, default=None, help="device whose trace to write (default: the current one)")
    parser.add_argument("--max-entries", type=int, default=20_000_000, help="history ring size (default 20M)")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- prog.py [args...]")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_streamalloc_version.version()}")
    args = parser.parse_args()

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if bool(program) == bool(args.from_pickle):
        parser.error("give either --from-pickle SNAPSHOT or -- prog.py [args...]")

    status = 0
    if args.from_pickle:
        with open(args.from_pickle, "rb") as f:
            snapshot = pickle.load(f)
        source = args.from_pickle
        device = args.device if args.device is not None else 0
    else:
        snapshot, status = run_program(program, args.max_entries)
        source = program[0]
        import torch

        device = args.device if args.device is not None else torch.cuda.current_device()
    entries = device_trace(snapshot, device, source)
    recorded_entries = len(entries)
    earlier = live_before_recording(snapshot, device, entries)
    events = as_events(entries)
    freed_early = trace_csv.allocations_before_recording(events)
    if earlier:
        print(
            f"capture_trace: {blocks(len(earlier))} ({sum(e['size'] for e in earlier):,} B) live before recording "
            "began and never named by the trace were written as alloc events at its start",
            file=sys.stderr,
        )
        events = as_events(earlier) + events
    if freed_early:
        print(
            f"capture_trace: {blocks(len(freed_early))} ({sum(e[2] for e in freed_early):,} B) are freed without "
            "an alloc (allocated before recording began); replay allocates them before the first event",
            file=sys.stderr,
        )
    if recorded_entries >= args.max_entries:
        print(
            f"capture_trace: warning: {recorded_entries} entries reached --max-entries; the oldest were overwritten "
            "and the trace starts mid-run",
            file=sys.stderr,
        )
    counts = write_trace(events, args.output)
    # Native's peak counts what it held before recording began, at least.
    peak_live, peak_reserved, _ = trace_csv.native_figures(freed_early + events)
    summarize(args.output, counts, peak_live, peak_reserved)
    return status


if __name__ == "__main__":
    sys.exit(main())
