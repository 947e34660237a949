"""install() before a fork, CUDA only in the child: with torch's own
allocator a program may fork before its first CUDA call and use CUDA in the
child, so installing streamalloc must not initialise CUDA in the parent."""

import multiprocessing

import torch

from _common import emit, select_allocator


def child(conn):
    try:
        conn.send(torch.ones(10, device="cuda").sum().item())
    except Exception as error:  # the parent reports it
        conn.send(f"{type(error).__name__}: {error}")
    finally:
        conn.close()


if __name__ == "__main__":
    select_allocator("streamalloc")
    import streamalloc

    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=child, args=(child_end,))
    process.start()
    answer = parent_end.recv()
    process.join()
    emit({
        "child_answer": answer,
        "child_exit": process.exitcode,
        "installed": streamalloc.is_installed(),
        "parent_can_use_cuda": torch.ones(4, device="cuda").sum().item(),
    })
