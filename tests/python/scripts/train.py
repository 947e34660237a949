"""Trains a GPT-2-sized transformer (bench/workloads/gpt2_model.py, with
attention spelled out) and a ResNet-50 for a few steps under one allocator
(argv[1]: native, streamalloc or streamalloc_plain) with fixed seeds and deterministic kernels,
and prints every step's loss and the peak memory.

Usage: train.py MODE [gpt2|resnet ...]   (both models by default; MODE as select_allocator)
"""

import os
import sys

# cuBLAS reads this when it first initialises; deterministic mode needs it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import random  # noqa: E402

import torch  # noqa: E402

from _common import BENCH_WORKLOADS, emit, select_allocator  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "native"
MODELS = sys.argv[2:] or ["gpt2", "resnet"]
select_allocator(MODE)

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, BENCH_WORKLOADS)
from gpt2_model import gpt2, gpt2_config  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

SEED = 1234
# GPT-2 small's shape (12 layers, width 768, 12 heads, 50257 tokens), head
# tied to the token embedding, every weight drawn from N(0, 0.02).
GPT2_CONFIG = gpt2_config(scaled_residual_init=False, deterministic_attention=True)


class GlobalMeanPool(nn.Module):
    # Replaces ResNet's AdaptiveAvgPool2d, whose CUDA backward has no
    # deterministic implementation; a mean over H and W is the same function.
    def forward(self, x):
        return x.mean(dim=(2, 3), keepdim=True)


def peak_memory():
    peaks = {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }
    if MODE != "native":
        import streamalloc

        stats = streamalloc.stats()
        peaks["peak_mapped_chunks"] = stats["vmm.mapped_chunks.peak"]
        peaks["chunk_maps"] = stats["vmm.num_chunk_maps"]
    return peaks


def train_gpt2(steps=6, batch=8, min_len=32, max_len=512):
    torch.manual_seed(SEED)
    lengths = random.Random(SEED)
    data = torch.Generator().manual_seed(SEED)
    model = gpt2(GPT2_CONFIG).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    losses, seen_lengths = [], []
    for _ in range(steps):
        length = lengths.randint(min_len, max_len)
        tokens = torch.randint(0, 50257, (batch, length + 1), generator=data).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        seen_lengths.append(length)
    return {"losses": losses, "lengths": seen_lengths}


def train_resnet(steps=4, sizes=(16, 24, 32)):
    import torchvision

    torch.manual_seed(SEED)
    batches = random.Random(SEED)
    data = torch.Generator().manual_seed(SEED)
    model = torchvision.models.resnet50(weights=None)
    model.avgpool = GlobalMeanPool()
    model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses, seen_batches = [], []
    for _ in range(steps):
        batch = batches.choice(sizes)
        images = torch.randn(batch, 3, 224, 224, generator=data).cuda()
        labels = torch.randint(0, 1000, (batch,), generator=data).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        seen_batches.append(batch)
    return {"losses": losses, "batches": seen_batches}


result = {"mode": MODE, "allocator": None}
for name in MODELS:
    torch.cuda.reset_peak_memory_stats()
    run = train_gpt2() if name == "gpt2" else train_resnet()
    run.update(peak_memory())
    result[name] = run
    result["allocator"] = torch.cuda.memory.get_allocator_backend()
emit(result)
