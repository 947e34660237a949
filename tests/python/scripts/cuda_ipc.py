"""CUDA IPC through torch.multiprocessing: this process (allocator argv[1])
fills a tensor and sends it to a spawned child (allocator argv[2]), which
checks the values, adds one in place and replies; the parent then checks
the child's writes. A small tensor (split block of a shared segment) and a
large one travel together."""

import sys

import torch
import torch.multiprocessing as mp

from _common import emit, select_allocator

MiB = 1 << 20


def child(mode, inbox, outbox):
    select_allocator(mode)
    small, large = inbox.get()
    ok = bool((small == 3).all().item()) and bool((large == torch.arange(large.numel(), device=large.device)).all().item())
    small.add_(1)
    large.add_(1)
    torch.cuda.synchronize()
    outbox.put({"child_read_ok": ok, "child_backend": torch.cuda.memory.get_allocator_backend()})
    del small, large
    inbox.get()  # wait until the parent has read the writes


if __name__ == "__main__":
    parent_mode, child_mode = sys.argv[1], sys.argv[2]
    select_allocator(parent_mode)
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=child, args=(child_mode, inbox, outbox))
    process.start()
    small = torch.full((1000,), 3, dtype=torch.int32, device="cuda")
    large = torch.arange(3 * MiB, dtype=torch.int64, device="cuda")
    inbox.put((small, large))
    reply = outbox.get(timeout=120)
    torch.cuda.synchronize()
    reply["parent_sees_writes"] = bool((small == 4).all().item()) and bool(
        (large == torch.arange(1, large.numel() + 1, device="cuda")).all().item()
    )
    inbox.put(None)
    process.join(timeout=120)
    reply["child_exit"] = process.exitcode
    emit(reply)
