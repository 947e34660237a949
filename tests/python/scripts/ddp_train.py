"""DistributedDataParallel training over NCCL, one process per GPU, under
one allocator: a small causal transformer for a few steps with fixed seeds
and deterministic kernels. Every rank selects the allocator before CUDA is
touched; rank 0 prints every rank's losses and a hash of its final weights.

Usage: torchrun --standalone --nproc_per_node=2 ddp_train.py --allocator native|streamalloc [--steps N]
"""

import os

# cuBLAS reads this when it first initialises; deterministic mode needs it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# NVLink multicast stays off on the lent multi-GPU machines (KINDS.md):
# set here too, whatever launched this process.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402

from _common import emit, select_allocator  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=("native", "streamalloc"), required=True)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
select_allocator(args.allocator)

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

SEED = 4321
VOCAB = 2048
WIDTH = 256
LAYERS = 4
HEADS = 4
MAX_LEN = 256
BATCH = 8


class CausalSelfAttention(nn.Module):
    # Spelled out rather than scaled_dot_product_attention, whose fused
    # backward kernels are not deterministic.
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        mask = torch.triu(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        batch, length, width = x.shape
        head_width = width // HEADS
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, HEADS, head_width).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_width))
        scores = scores.masked_fill(self.mask[:length, :length], float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, length, width)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attention = CausalSelfAttention()
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(approximate="tanh"), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SmallTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, WIDTH)
        self.position_embedding = nn.Embedding(MAX_LEN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
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


def weights_sha256(model):
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
dist.init_process_group("nccl", device_id=device)
rank, world_size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(SEED)
model = DistributedDataParallel(SmallTransformer().to(device), device_ids=[local_rank])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
# The same lengths on every rank (DDP needs every rank in each step), each
# rank its own tokens.
lengths = random.Random(SEED)
data = torch.Generator().manual_seed(SEED + 1000 * rank)
losses, seen_lengths = [], []
for _ in range(args.steps):
    length = lengths.randint(MAX_LEN // 4, MAX_LEN - 1)
    tokens = torch.randint(0, VOCAB, (BATCH, length + 1), generator=data).to(device)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    seen_lengths.append(length)
torch.cuda.synchronize()

report = {
    "rank": rank,
    "device": local_rank,
    "allocator": torch.cuda.memory.get_allocator_backend(),
    "losses": losses,
    "lengths": seen_lengths,
    "weights_sha256": weights_sha256(model.module),
    "peak_allocated": torch.cuda.max_memory_allocated(device),
    "peak_reserved": torch.cuda.max_memory_reserved(device),
}
reports = [None] * world_size
dist.all_gather_object(reports, report)
if rank == 0:
    emit({"mode": args.allocator, "world_size": world_size, "ranks": reports})
dist.destroy_process_group()
