#!/usr/bin/env python3
"""Plots reserved vs allocated memory over replayed allocation traces, one
panel per trace and one reserved curve per allocator, into a PNG.

Input: timeline CSVs `op,allocated_bytes,reserved_bytes`, as written by
`streamalloc-replay --timeline FILE` and `bench/replay_torch.py
--timeline-dir DIR` (named TRACE.ALLOCATOR.csv there):

    python scripts/plot_replay.py -o replay_memory.png --timeline-dir DIR
    python scripts/plot_replay.py -o resnet.png --title resnet50 \\
        native=native.csv streamalloc=streamalloc.csv
"""

import argparse
import csv
import os
import sys

import _streamalloc_version  # the checkout's version (CMakeLists.txt)

# Curve order and colours; allocators not listed here follow in name order.
KNOWN = {
    "recorded": ("native (recorded)", "tab:gray"),  # drawn dashed: replays often lie on it
    "native": ("native", "tab:red"),
    "expandable": ("expandable_segments", "tab:orange"),
    "cuda_async": ("cudaMallocAsync", "tab:purple"),
    "streamalloc": ("streamalloc", "tab:blue"),
    "streamalloc_plain": ("streamalloc plain", "tab:cyan"),
}
MAX_POINTS = 4000


def read_timeline(path):
    ops, allocated, reserved = [], [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["op", "allocated_bytes", "reserved_bytes"]:
            sys.exit(f"plot_replay: {path}: header {header} is not op,allocated_bytes,reserved_bytes")
        for row in reader:
            ops.append(int(row[0]))
            allocated.append(int(row[1]))
            reserved.append(int(row[2]))
    if not ops:
        sys.exit(f"plot_replay: {path} has no rows")
    return ops, allocated, reserved


def downsample(ops, values):
    """At most MAX_POINTS points, each bucket keeping its maximum, so peaks
    survive the thinning."""
    n = len(ops)
    if n <= MAX_POINTS:
        return ops, values
    step = n / MAX_POINTS
    xs, ys = [], []
    for b in range(MAX_POINTS):
        lo, hi = int(b * step), max(int((b + 1) * step), int(b * step) + 1)
        chunk = values[lo:hi]
        i = max(range(len(chunk)), key=chunk.__getitem__)
        xs.append(ops[lo + i])
        ys.append(chunk[i])
    return xs, ys


def sort_key(name):
    keys = list(KNOWN)
    return (keys.index(name), "") if name in keys else (len(keys), name)


def group_dir(directory):
    """{trace: {allocator: path}} from TRACE.ALLOCATOR.csv names."""
    groups = {}
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".csv") or entry.count(".") < 2:
            continue
        trace, allocator = entry[: -len(".csv")].rsplit(".", 1)
        groups.setdefault(trace, {})[allocator] = os.path.join(directory, entry)
    return groups


def require_matplotlib():
    """matplotlib.pyplot, or exit with one line saying how to install it
    (scripts/setup.sh does not: only this script needs it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        sys.exit(f"plot_replay: needs matplotlib, which {sys.executable} cannot import ({error}); "
                 f"install it with: {sys.executable} -m pip install matplotlib")
    return plt


def plot(groups, output, title):
    plt = require_matplotlib()

    gib = float(1 << 30)
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.8 * len(groups)), squeeze=False)
    for ax, (trace, files) in zip(axes[:, 0], groups.items()):
        timelines = {name: read_timeline(path) for name, path in files.items()}
        peak_live = max(max(t[1]) for t in timelines.values())
        # The densest timeline draws the allocated curve (every op when it
        # came from a per-op replay).
        densest = max(timelines.values(), key=lambda t: len(t[0]))
        xs, ys = downsample(densest[0], densest[1])
        ax.plot(xs, [y / gib for y in ys], color="black", linewidth=0.8, label=f"allocated (peak {peak_live / gib:.2f} GiB)")
        for name in sorted(timelines, key=sort_key):
            ops, _, reserved = timelines[name]
            label, colour = KNOWN.get(name, (name, None))
            xs, ys = downsample(ops, reserved)
            peak = max(reserved)
            ax.step(xs, [y / gib for y in ys], where="post", color=colour, linewidth=1.2,
                    linestyle="--" if name == "recorded" else "-",
                    label=f"{label} reserved (peak {peak / gib:.2f} GiB, {peak / peak_live:.3f}x)")
        ax.set_title(f"{title}: {trace}" if title else trace)
        ax.set_xlabel("allocate/free operation")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"plot_replay: wrote {output} ({len(groups)} trace(s))", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--timeline-dir", help="directory of TRACE.ALLOCATOR.csv timelines (one panel per trace)")
    parser.add_argument("--title", default="", help="title (prefix of each panel's title)")
    parser.add_argument("files", nargs="*", metavar="ALLOCATOR=CSV", help="timelines of one trace")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_streamalloc_version.version()}")
    args = parser.parse_args()
    if bool(args.timeline_dir) == bool(args.files):
        parser.error("give either --timeline-dir DIR or ALLOCATOR=CSV arguments")
    require_matplotlib()  # before reading the timelines, which can be large
    if args.timeline_dir:
        if not os.path.isdir(args.timeline_dir):
            sys.exit(f"plot_replay: {args.timeline_dir} is not a directory (no replay wrote timelines there)")
        groups = group_dir(args.timeline_dir)
        if not groups:
            sys.exit(f"plot_replay: no TRACE.ALLOCATOR.csv files in {args.timeline_dir}")
        plot(groups, args.output, args.title)
    else:
        files = {}
        for item in args.files:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                parser.error(f"'{item}' is not ALLOCATOR=CSV")
            files[name] = path
        plot({args.title or "replay": files}, args.output, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
