"""A multi-worker DataLoader (fork start method) under streamalloc while a
background thread keeps allocating and freeing CUDA memory, so the forks
happen while the allocator is busy. Each worker also frees a CUDA tensor it
inherited from the parent, which must be a silent no-op there. Every batch
feeds a float64 GPU matmul checked against the CPU; a worker that
deadlocked would trip the DataLoader's timeout."""

import threading

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import streamalloc
from _common import emit

streamalloc.install()

EPOCHS = 4
ITEMS = 96
FEATURES = 64


class Items(Dataset):
    def __init__(self):
        # Inherited by every forked worker, which drops it (worker_init).
        self.parent_tensor = torch.ones(1 << 18, device="cuda")

    def __len__(self):
        return ITEMS

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(FEATURES, generator=generator, dtype=torch.float64), index


def drop_parent_tensor(_worker_id):
    dataset = get_worker_info().dataset
    del dataset.parent_tensor


stop = threading.Event()
background_steps = [0]


def keep_allocating():
    # Its own stream, so the forks also land while blocks are in use on a
    # second stream.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        size = 1 << 12
        while not stop.is_set():
            x = torch.full((size,), 2.0, device="cuda")
            y = x * 3
            if float(y[-1]) != 6.0:
                raise AssertionError("background tensor has the wrong value")
            del x, y
            size = size * 2 if size < (1 << 22) else 1 << 12
            background_steps[0] += 1


weights = torch.randn(FEATURES, 16, dtype=torch.float64, device="cuda")
weights_cpu = weights.cpu()
dataset = Items()
loader = DataLoader(
    dataset,
    batch_size=8,
    num_workers=2,
    multiprocessing_context="fork",
    worker_init_fn=drop_parent_tensor,
    timeout=120,
)

worker = threading.Thread(target=keep_allocating)
worker.start()
batches = 0
seen = 0
max_error = 0.0
try:
    for _epoch in range(EPOCHS):  # a fresh pair of workers is forked per epoch
        for batch, indices in loader:
            out = batch.cuda() @ weights
            expected = batch @ weights_cpu
            max_error = max(max_error, float((out.cpu() - expected).abs().max()))
            batches += 1
            seen += int(indices.numel())
finally:
    stop.set()
    worker.join()

torch.cuda.synchronize()
emit(
    {
        "batches": batches,
        "items": seen,
        "max_error": max_error,
        "background_steps": background_steps[0],
        "parent_tensor_intact": bool((dataset.parent_tensor == 1).all()),
        "allocator": torch.cuda.memory.get_allocator_backend(),
    }
)
