"""FSDP2 (torch.distributed.fsdp.fully_shard) training in one process over
NCCL, world size 1, under one allocator: a small causal transformer
(bench/workloads/gpt2_model.py, attention spelled out), each block sharded
on its own and the root too, parameters in bf16 and gradients reduced in
fp32, for a few steps with fixed seeds and deterministic kernels. FSDP2
gathers and reduces on streams of its own, so memory is freed on one
stream while another may still use it, as in a multi-GPU run.

Usage: fsdp2_train.py MODE [--steps N] [--register-hook]
  MODE as select_allocator; --register-hook sets
  TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, so the process group
  registers the allocator's segments with NCCL (those of its snapshot when
  the communicator starts, then those its trace events announce).
"""

import os

# cuBLAS reads this when it first initialises; deterministic mode needs it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from _common import BENCH_WORKLOADS, emit, select_allocator  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--register-hook", action="store_true")
args = parser.parse_args()
if args.register_hook:
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
select_allocator(args.mode)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

sys.path.insert(0, BENCH_WORKLOADS)
from gpt2_model import gpt2, gpt2_config  # noqa: E402

torch.use_deterministic_algorithms(True)

SEED = 2468
VOCAB = 4096
MAX_LEN = 512
BATCH = 8
MODEL_CONFIG = gpt2_config(
    vocab_size=VOCAB, n_ctx=MAX_LEN, n_embd=512, n_layer=6, n_head=8,
    tied_head=False, scaled_residual_init=False, deterministic_attention=True,
)


def weights_sha256(model):
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().full_tensor().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


device = torch.device("cuda", 0)
torch.cuda.set_device(device)
with tempfile.TemporaryDirectory() as rendezvous:
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}/store", rank=0, world_size=1, device_id=device)

    torch.manual_seed(SEED)
    model = gpt2(MODEL_CONFIG).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.blocks:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    lengths = random.Random(SEED)
    data = torch.Generator().manual_seed(SEED + 1)
    losses, seen_lengths = [], []
    for _ in range(args.steps):
        length = lengths.randint(MAX_LEN // 4, MAX_LEN - 1)
        tokens = torch.randint(0, VOCAB, (BATCH, length + 1), generator=data).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seen_lengths.append(length)
    torch.cuda.synchronize()

    emit({
        "allocator": torch.cuda.memory.get_allocator_backend(),
        "losses": losses,
        "lengths": seen_lengths,
        "weights_sha256": weights_sha256(model),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "register_hook": os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK") == "1",
    })
    dist.destroy_process_group()
