#!/usr/bin/env python3
"""Writes a copy of every trace in a folder with each request size scaled.

A policy that holds only at the sizes of the traces it was measured on is
fitted to them; replaying the same programs with every size scaled (the
same order of allocations and frees, other shapes) shows that. Segment
events are dropped: they record the native allocator's segments for the
original sizes.

  scripts/scale_traces.py SRC_DIR DST_DIR FACTOR
  build/bin/streamalloc-replay --all DST_DIR
"""
import gzip
import os
import sys


def open_trace(path, mode):
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def scale_trace(src, dst, factor):
    with open_trace(src, "r") as lines, open_trace(dst, "w") as out:
        out.write(lines.readline())  # the header
        for line in lines:
            fields = line.rstrip("\n").split(",")
            if fields[0].startswith("segment_"):
                continue
            size = int(fields[2])
            fields[2] = str(max(1, int(size * factor)) if size > 0 else 0)
            out.write(",".join(fields) + "\n")


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__.strip())
    src_dir, dst_dir, factor = argv[1], argv[2], float(argv[3])
    if factor <= 0:
        sys.exit("scale_traces: FACTOR must be positive")
    os.makedirs(dst_dir, exist_ok=True)
    names = sorted(n for n in os.listdir(src_dir) if n.endswith((".trace.csv", ".trace.csv.gz")))
    if not names:
        sys.exit(f"scale_traces: no *.trace.csv or *.trace.csv.gz in {src_dir}")
    for name in names:
        scale_trace(os.path.join(src_dir, name), os.path.join(dst_dir, name), factor)
    print(f"scale_traces: {len(names)} traces scaled by {factor} into {dst_dir}")


if __name__ == "__main__":
    main(sys.argv)
