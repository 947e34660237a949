"""DistributedDataParallel training over NCCL, one process per GPU, under
one allocator: a small causal transformer (bench/workloads/gpt2_model.py,
scaled down, attention spelled out) for a few steps with fixed seeds and
deterministic kernels. Every rank selects the allocator before CUDA is
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
import random  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from _common import BENCH_WORKLOADS, emit, select_allocator  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=("native", "streamalloc"), required=True)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
select_allocator(args.allocator)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, BENCH_WORKLOADS)
from gpt2_model import gpt2, gpt2_config  # noqa: E402

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
# A small causal transformer: untied head, every weight drawn from N(0, 0.02).
MODEL_CONFIG = gpt2_config(
    vocab_size=VOCAB, n_ctx=MAX_LEN, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
    tied_head=False, scaled_residual_init=False, deterministic_attention=True,
)


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
model = DistributedDataParallel(gpt2(MODEL_CONFIG).to(device), device_ids=[local_rank])
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
