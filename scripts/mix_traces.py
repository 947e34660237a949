#!/usr/bin/env python3
"""Writes one trace in which two traces run side by side, as two models
served by one process do: B's events are interleaved with A's in
proportion (A's i-th of n events at i/n, B's j-th of m at j/m; A first on
a tie), each trace keeps its own order, B's addresses are moved past
A's, and B's side streams get numbers A does not use. B's default stream
(0) stays the default stream that A uses too, as threads of one process
share it, unless --own-default-stream gives it a stream of its own.
Segment events are dropped (they record the native allocator of each
program alone); so are the other events that replay ignores. A trace
with free_requested lines and no free_completed has its frees written as
free_completed, as replay would take them alone.

A policy measured on programs run one at a time may not hold when two
share the allocator; replaying mixed pairs shows it:

  scripts/mix_traces.py tests/data/traces/bert_serve.trace.csv.gz \\
      tests/data/traces/moe_train.trace.csv.gz /tmp/mix/bert_serve+moe_train.trace.csv.gz
  build/bin/streamalloc-replay --all /tmp/mix
"""
import argparse
import csv
import sys

import _streamalloc_version  # the checkout's version (CMakeLists.txt)
import trace_csv

REPLAYED = ("alloc", "free_requested", "free_completed")
GAP = 1 << 30  # between A's highest byte and B's lowest address


def read(path):
    try:
        events, _, _ = trace_csv.read_events(path, REPLAYED)
    except trace_csv.TraceFormatError as e:
        raise SystemExit(f"mix_traces.py: {e}") from None
    if not events:
        raise SystemExit(f"mix_traces.py: {path} has no alloc or free event")
    # Replay frees at free_requested only in a trace with no free_completed;
    # once mixed with one that has them, such a trace would never free.
    events, _ = trace_csv.free_at_requests_without_completions(events)
    return events


def moved(a, b, own_default_stream):
    """B's events with addresses past A's and streams A does not use."""
    a_end = max(addr + size for _, addr, size, _ in a)
    b_start = min(addr for _, addr, _, _ in b)
    shift = (a_end + GAP) // GAP * GAP - b_start + GAP
    taken = {stream for *_, stream in a}
    renamed = {}
    next_free = max(taken) + 1
    for *_, stream in b:
        if stream in renamed or (stream == 0 and not own_default_stream):
            continue
        renamed[stream] = next_free
        next_free += 1
    return [(action, addr + shift, size, renamed.get(stream, stream)) for action, addr, size, stream in b]


def interleaved(a, b):
    keyed = [(i * len(b), 0, i) for i in range(len(a))] + [(j * len(a), 1, j) for j in range(len(b))]
    keyed.sort()
    return [(a if which == 0 else b)[k] for _, which, k in keyed]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the first trace")
    parser.add_argument("b", help="the second trace, moved and interleaved")
    parser.add_argument("out", help="the mixed trace (gzip'd when the name ends in .gz)")
    parser.add_argument("--own-default-stream", action="store_true",
                        help="B's default stream becomes a stream of its own instead of A's default stream")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_streamalloc_version.version()}")
    args = parser.parse_args(argv[1:])
    a, b = read(args.a), read(args.b)
    events = interleaved(a, moved(a, b, args.own_default_stream))
    with trace_csv.open_for_writing(args.out) as out:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(trace_csv.COLUMNS)
        writer.writerows(events)
    print(f"mix_traces.py: {len(a)} + {len(b)} events into {args.out}")


if __name__ == "__main__":
    main(sys.argv)
