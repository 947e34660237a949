#!/usr/bin/env python3
"""What receiving a CUDA tensor from another process costs, under each
allocator (the sender and the receiver both use it, as in a
torch.multiprocessing program):

  native             torch's default caching allocator
  expandable         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  streamalloc        streamalloc's defaults (mapped chunks)
  streamalloc_plain  STREAMALLOC_CONF=expandable_segments:False

    python bench/ipc_bench.py [--modes native,streamalloc] [--count 200]
        [--json FILE]

Each mode runs in a process of its own (the receiver), which spawns a
sender per size. One tensor at a time, the receiver asks for it, the
sender makes it, pickles it the way torch.multiprocessing does (the
export) and drops its own reference, and the receiver times three steps:
unpickling (the import: opening or mapping the sender's memory), reading
its last element to the host (the wait on the sender's event and a copy),
and dropping it (closing or unmapping, and torch's release of the
sender's reference). Medians and [p10, p90] over the tensors after
--warmup.
"""

import argparse
import json
import os
import sys
import time

from _driver import check_choices, enter_mode, finish, run_worker
from python_bench import summarize

MODES = ["native", "expandable", "streamalloc", "streamalloc_plain"]
# (label, float32 elements)
SIZES = [("20 B", 5), ("4 MiB", 1 << 20), ("64 MiB", 16 << 20)]
STEPS = ("receive", "read", "release")


def log(message):
    print(f"ipc_bench[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def sender(mode, elements, count, connection):
    """Makes and sends one tensor per request, dropping its own reference
    at once (torch keeps the memory until the receiver lets it go), then
    stays alive until the receiver says it is done: importing needs the
    sender's process."""
    torch = enter_mode(mode, "ipc_bench")
    import torch.multiprocessing  # noqa: F401 (registers the CUDA tensor reductions)
    from multiprocessing.reduction import ForkingPickler

    for i in range(count):
        connection.recv_bytes()
        tensor = torch.full([elements], float(i), device="cuda")
        torch.cuda.synchronize()
        connection.send_bytes(ForkingPickler.dumps(tensor))
        del tensor
    connection.recv_bytes()


def receive_size(mode, elements, count, warmup):
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    context = mp.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(target=sender, args=(mode, elements, count, theirs))
    process.start()
    theirs.close()  # so that a sender that dies ends our reads instead of leaving them waiting
    samples = {step: [] for step in STEPS}
    try:
        for i in range(count):
            mine.send_bytes(b"next")
            payload = mine.recv_bytes()
            start = time.perf_counter_ns()
            tensor = ForkingPickler.loads(payload)
            received = time.perf_counter_ns()
            value = tensor[-1].item()
            read = time.perf_counter_ns()
            del tensor
            released = time.perf_counter_ns()
            if value != float(i):
                raise SystemExit(f"ipc_bench: tensor {i} holds {value} at its end")
            if i >= warmup:
                for step, ns in zip(STEPS, (received - start, read - received, released - read)):
                    samples[step].append(ns / 1000)
        mine.send_bytes(b"done")
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    if process.exitcode != 0:
        raise SystemExit(f"ipc_bench: the sender exited with {process.exitcode}")
    return {step: summarize(values) for step, values in samples.items()}


def worker(mode, out_path, args):
    torch = enter_mode(mode, "ipc_bench")
    result = {"mode": mode, "torch": torch.__version__, "allocator_backend": torch.cuda.get_allocator_backend(),
              "count": args.count, "warmup": args.warmup, "sizes": {}}
    for label, elements in SIZES:
        result["sizes"][label] = receive_size(mode, elements, args.count, args.warmup)
        log(f"{mode} {label}: receive median {result['sizes'][label]['receive']['median']:.1f} us")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def fmt_us(summary):
    return f"{summary['median']:.1f} us [{summary['p10']:.1f}, {summary['p90']:.1f}]"


def print_table(results, modes):
    print("CUDA IPC, one tensor at a time: median [p10, p90] per tensor\n")
    print("| size | allocator | receive | read last element | release |")
    print("|---|---|---|---|---|")
    for label, _ in SIZES:
        for mode in modes:
            result = results[mode]
            if "error" in result:
                print(f"| {label} | {mode} | failed: {result['error']} | | |")
                continue
            figures = result["sizes"][label]
            print(f"| {label} | {mode} | " + " | ".join(fmt_us(figures[step]) for step in STEPS) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--count", type=int, default=200, help="tensors per size (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="first tensors not counted (default 10)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mode (default 300)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count <= args.warmup:
        parser.error("--count must be larger than --warmup")
    if args.worker:
        worker(args.worker, args.out, args)
        return 0
    modes = args.modes.split(",")
    check_choices(parser, "mode", modes, MODES)
    results = {}
    for mode in modes:
        log(f"running mode {mode}")
        results[mode] = run_worker(__file__, mode, [f"--count={args.count}", f"--warmup={args.warmup}"], args.timeout)
    print_table(results, modes)
    return finish("ipc_bench", modes, results, args.json)


if __name__ == "__main__":
    sys.exit(main())
