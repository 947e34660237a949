"""CUDA IPC through three processes, as PyTorch's test_cuda_send_many runs
it: a producer sends small tensors and drops its own references at once, a
relay receives each and sends a copy of its own on, and a summer adds them
up. Every process uses the allocator argv[1] and stays alive until the sum
is in; argv[2] tensors travel. The relay both imports and exports memory,
which a two-process round trip never does."""

import queue
import sys
import time

import torch
import torch.multiprocessing as mp

from _common import emit, select_allocator

ELEMENTS = 5


def producer(mode, outbox, count, done):
    select_allocator(mode)
    for i in range(count):
        t = torch.full([ELEMENTS], i, device="cuda", dtype=torch.long)
        outbox.put(t)
        del t
    done.wait()


def relay(mode, inbox, outbox, count, done):
    select_allocator(mode)
    for _ in range(count):
        t = inbox.get()
        outbox.put(t.clone())
    done.wait()


def summer(mode, inbox, results, count, done):
    select_allocator(mode)
    total = torch.zeros(ELEMENTS, device="cuda", dtype=torch.long)
    for _ in range(count):
        t = inbox.get()
        total += t
    results.put(total.tolist())
    done.wait()


def wait_for_sum(results, processes, timeout):
    """The summer's list, or None once a process has died or time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in processes):
                return None
    return None


if __name__ == "__main__":
    mode, count = sys.argv[1], int(sys.argv[2])
    context = mp.get_context("spawn")
    first, second, results = context.Queue(), context.Queue(), context.Queue()
    done = context.Event()
    processes = [
        context.Process(target=producer, args=(mode, first, count, done)),
        context.Process(target=relay, args=(mode, first, second, count, done)),
        context.Process(target=summer, args=(mode, second, results, count, done)),
    ]
    start = time.monotonic()
    for p in processes:
        p.start()
    total = wait_for_sum(results, processes, timeout=240)
    seconds = time.monotonic() - start
    done.set()
    for p in processes:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    emit({
        "sum": total,
        "expected": [count * (count - 1) // 2] * ELEMENTS,
        "exit_codes": [p.exitcode for p in processes],
        "seconds": round(seconds, 2),
    })
