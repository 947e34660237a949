#!/usr/bin/env python3
"""Writes a copy of every trace in a folder with each request size scaled.

A policy that holds only at the sizes of the traces it was measured on is
fitted to them; replaying the same programs with every size scaled (the
same order of allocations and frees, other shapes) shows that. Segment
events are dropped: they record the native allocator's segments for the
original sizes.

  scripts/scale_traces.py tests/data/traces /tmp/scaled 1.1
  build/bin/streamalloc-replay --all /tmp/scaled
"""
import argparse
import csv
import os
import sys

import _streamalloc_version  # the checkout's version (CMakeLists.txt)
import trace_csv


def scale_trace(src, dst, factor):
    with trace_csv.open_for_reading(src) as lines, trace_csv.open_for_writing(dst) as out:
        reader = csv.reader(lines)
        writer = csv.writer(out, lineterminator="\n")
        header = next(reader, None)
        if header is None:
            raise SystemExit(f"scale_traces.py: {src} is empty")
        try:
            action, _, size, _ = trace_csv.column_positions(header, src)
        except trace_csv.TraceFormatError as e:
            raise SystemExit(f"scale_traces.py: {e}") from None
        writer.writerow(header)
        for row in reader:
            if row[action] in trace_csv.GROWS + trace_csv.SHRINKS:
                continue
            if row[action] in ("alloc", "free_requested", "free_completed"):
                bytes_ = trace_csv.whole_number(row[size])
                row[size] = str(max(1, int(bytes_ * factor)) if bytes_ > 0 else 0)
            writer.writerow(row)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src_dir", help="folder of *.trace.csv[.gz] files")
    parser.add_argument("dst_dir", help="folder to write the scaled copies to (created if missing)")
    parser.add_argument("factor", type=float, help="what every request size is multiplied by (> 0)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_streamalloc_version.version()}")
    args = parser.parse_args(argv[1:])
    if not args.factor > 0:
        parser.error("factor must be positive")
    names = sorted(n for n in os.listdir(args.src_dir) if n.endswith((".trace.csv", ".trace.csv.gz")))
    if not names:
        parser.error(f"no *.trace.csv or *.trace.csv.gz in {args.src_dir}")
    os.makedirs(args.dst_dir, exist_ok=True)
    for name in names:
        scale_trace(os.path.join(args.src_dir, name), os.path.join(args.dst_dir, name), args.factor)
    print(f"scale_traces.py: {len(names)} traces scaled by {args.factor} into {args.dst_dir}")


if __name__ == "__main__":
    main(sys.argv)
