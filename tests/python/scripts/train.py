"""Trains a GPT-2-sized transformer and a ResNet-50 for a few steps under
one allocator (argv[1]: native or streamalloc) with fixed seeds and
deterministic kernels, and prints every step's loss and the peak memory.

Usage: train.py MODE [gpt2|resnet ...]   (both models by default)
"""

import os
import sys

# cuBLAS reads this when it first initialises; deterministic mode needs it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import math  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402

from _common import emit, select_allocator  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "native"
MODELS = sys.argv[2:] or ["gpt2", "resnet"]
select_allocator(MODE)

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

SEED = 1234


class CausalSelfAttention(nn.Module):
    # Attention is spelled out rather than taken from
    # scaled_dot_product_attention, whose fused backward kernels are not
    # deterministic.
    def __init__(self, width: int, heads: int, max_len: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        batch, length, width = x.shape
        head_width = width // self.heads
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, head_width).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_width))
        scores = scores.masked_fill(self.mask[:length, :length], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        y = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        return self.proj(y)


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, max_len: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, max_len)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT2(nn.Module):
    """GPT-2 small's shape: 12 layers, width 768, 12 heads, 50257 tokens."""

    def __init__(self, vocab=50257, width=768, layers=12, heads=12, max_len=1024):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, max_len) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token_embedding.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GlobalMeanPool(nn.Module):
    # Replaces ResNet's AdaptiveAvgPool2d, whose CUDA backward has no
    # deterministic implementation; a mean over H and W is the same function.
    def forward(self, x):
        return x.mean(dim=(2, 3), keepdim=True)


def peak_memory():
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }


def train_gpt2(steps=6, batch=8, min_len=32, max_len=512):
    torch.manual_seed(SEED)
    lengths = random.Random(SEED)
    data = torch.Generator().manual_seed(SEED)
    model = GPT2().cuda()
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
