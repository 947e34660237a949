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
import gzip
import os
import sys

import _streamalloc_version  # the checkout's version (CMakeLists.txt)


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
