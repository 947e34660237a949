"""Several Python threads allocate and free CUDA memory through streamalloc
at once, each on its own stream, while autograd's device threads run the
backward passes they start. Every live tensor holds a value unique to its
thread and step and is checked before it is freed: two live tensors sharing
memory would show up as a wrong value. Gradients are checked against a
float64 CPU reference, and after everything is freed the allocated bytes
are back where they started (the math is elementwise on purpose: cuBLAS
would keep a workspace per stream allocated)."""

import threading

import torch

import streamalloc
from _common import emit

streamalloc.install()

THREADS = 6
STEPS = 60
errors = []
checks = [0] * THREADS


def inputs(thread_id, step):
    generator = torch.Generator().manual_seed(thread_id * 10_000 + step)
    x = torch.randn(32, 48, generator=generator, dtype=torch.float64)
    w = torch.randn(32, 48, generator=generator, dtype=torch.float64)
    return x, w


def reference_grad(thread_id, step):
    x, w = inputs(thread_id, step)
    w = w.clone().requires_grad_(True)
    (x * w).tanh().pow(2).sum().backward()
    return w.grad


def work(thread_id):
    try:
        stream = torch.cuda.Stream()
        live = []
        with torch.cuda.stream(stream):
            for step in range(STEPS):
                value = float(thread_id * 1000 + step)
                numel = 1 << (10 + (thread_id + step) % 12)  # 4 KiB .. 8 MiB of float32
                live.append((torch.full((numel,), value, device="cuda"), value))
                if len(live) > 8:
                    tensor, expected = live.pop(0)
                    if not bool((tensor == expected).all()):
                        errors.append(f"thread {thread_id} step {step}: a live tensor was overwritten")
                    checks[thread_id] += 1
                    del tensor

                x, w = inputs(thread_id, step)
                w = w.cuda().requires_grad_(True)
                (x.cuda() * w).tanh().pow(2).sum().backward()
                grad = w.grad.cpu()
                want = reference_grad(thread_id, step)
                if not torch.allclose(grad, want, rtol=1e-9, atol=1e-12):
                    errors.append(f"thread {thread_id} step {step}: gradient differs by {float((grad - want).abs().max())}")
                checks[thread_id] += 1
            for tensor, expected in live:
                if not bool((tensor == expected).all()):
                    errors.append(f"thread {thread_id}: a live tensor was overwritten at the end")
                checks[thread_id] += 1
            live.clear()
        stream.synchronize()
    except Exception as error:  # reported through the result, not lost in a thread
        errors.append(f"thread {thread_id}: {type(error).__name__}: {error}")


torch.cuda.synchronize()
baseline = torch.cuda.memory_allocated()
threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
torch.cuda.synchronize()
after = torch.cuda.memory_allocated()
stats = streamalloc.stats()

emit(
    {
        "threads": THREADS,
        "checks": sum(checks),
        "errors": errors[:20],
        "allocated_before": baseline,
        "allocated_after": after,
        "allocator": torch.cuda.memory.get_allocator_backend(),
        "num_ooms": stats.get("num_ooms", 0),
    }
)
