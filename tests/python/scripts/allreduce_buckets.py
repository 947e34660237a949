"""All-reduce buffers are never reused before their collective finishes.
Each step, on every rank, for buckets of a size that varies from step to
step (the same on all ranks):

  kept     all_reduce(async_op=True) on a fresh bucket; checked after wait().
  dropped  all_reduce(async_op=True) on a fresh bucket, then the bucket and
           its Work are deleted at once: only what ProcessGroupNCCL does
           (record_stream on its stream, or stashing the tensor) keeps the
           memory from being handed out again.
  side     the caller's own pattern: the collective runs on a side stream,
           its result is copied out there, the bucket gets record_stream(side)
           and is deleted: only the allocator's record_stream protects it.

Right after each bucket is given up, "filler" tensors of the same size are
allocated on the current stream and filled with a sentinel, so a block
released too early is taken by a filler at once. One rank (alternating)
sleeps on the GPU before each collective, so the other rank's collective is
still waiting for it while the fillers are written: early reuse shows up
as a wrong sum, or as a filler overwritten by the collective's result.

Usage: torchrun --standalone --nproc_per_node=2 allreduce_buckets.py [--allocator native|streamalloc] [--steps N]
"""

import os

# NVLink multicast stays off on the lent multi-GPU machines (KINDS.md):
# set here too, whatever launched this process.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import argparse  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402

from _common import emit, select_allocator  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=("native", "streamalloc"), default="streamalloc")
parser.add_argument("--steps", type=int, default=120)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
select_allocator(args.allocator)

import torch.distributed as dist  # noqa: E402

SEED = 99
# Bucket sizes in float32 elements: odd counts that round up, exact powers
# of two, just past a rounding step, and DDP's default 25 MiB bucket.
BUCKET_NUMELS = (1000, 1024, 16_384 + 1, 262_144, 262_144 + 128, 1_000_003, 2_621_440, 25 * 262_144)
FILLERS_PER_BUCKET = 3
# About 1 ms of GPU clock on an H200: far longer than the host takes to
# free a bucket and write the fillers.
DELAY_CYCLES = 2_000_000

torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
dist.init_process_group("nccl", device_id=device)
rank, world_size = dist.get_rank(), dist.get_world_size()

side = torch.cuda.Stream(device)
sizes = random.Random(SEED)
errors = []
counts = {"kept": 0, "dropped": 0, "side": 0, "fillers": 0}
in_flight = {"dropped": 0, "side": 0}


def contribution(numel, step, which, from_rank):
    """What `from_rank` puts into bucket `which` at `step`: small integers,
    so float32 sums are exact."""
    values = torch.arange(numel, dtype=torch.float32, device=device).remainder_(251)
    return values.add_(1000 * (from_rank + 1) + 10 * step + which)


def expected_sum(numel, step, which):
    total = contribution(numel, step, which, 0)
    for other in range(1, world_size):
        total.add_(contribution(numel, step, which, other))
    return total


def delay_if_late(step, stream):
    if rank == step % world_size:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(DELAY_CYCLES)


def add_fillers(numel, step, fillers):
    sentinel = -float(step + 1)
    for _ in range(FILLERS_PER_BUCKET):
        fillers.append((torch.full((numel,), sentinel, dtype=torch.float32, device=device), sentinel))


def check(tensor, want, what):
    if not torch.equal(tensor, want):
        wrong = int((tensor != want).sum())
        errors.append(f"rank {rank} {what}: {wrong} of {tensor.numel()} elements differ")


current = torch.cuda.current_stream(device)
seen_numels = []
for step in range(args.steps):
    numel = sizes.choice(BUCKET_NUMELS)
    seen_numels.append(numel)
    fillers = []

    # kept: checked after wait().
    delay_if_late(step, current)
    kept = contribution(numel, step, 0, rank)
    work = dist.all_reduce(kept, async_op=True)
    add_fillers(numel, step, fillers)
    work.wait()
    check(kept, expected_sum(numel, step, 0), f"step {step} kept bucket of {numel}")
    counts["kept"] += 1
    del kept, work

    # dropped: freed as soon as the collective is issued.
    delay_if_late(step, current)
    dropped = contribution(numel, step, 1, rank)
    work = dist.all_reduce(dropped, async_op=True)
    if not work.is_completed():
        in_flight["dropped"] += 1
    del dropped, work
    add_fillers(numel, step, fillers)
    counts["dropped"] += 1

    # side: the collective on a side stream, protected by record_stream only.
    result = torch.empty(numel, dtype=torch.float32, device=device)
    bucket = contribution(numel, step, 2, rank)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        delay_if_late(step, side)
        dist.all_reduce(bucket)
        result.copy_(bucket)
    bucket.record_stream(side)
    if not side.query():
        in_flight["side"] += 1
    del bucket
    add_fillers(numel, step, fillers)
    current.wait_stream(side)
    check(result, expected_sum(numel, step, 2), f"step {step} side-stream bucket of {numel}")
    counts["side"] += 1

    torch.cuda.synchronize(device)
    for filler, sentinel in fillers:
        check(filler, torch.full_like(filler, sentinel), f"step {step} filler of {numel} (sentinel {sentinel})")
        counts["fillers"] += 1
    del fillers, result

torch.cuda.synchronize(device)
dist.barrier()
report = {
    "rank": rank,
    "allocator": torch.cuda.memory.get_allocator_backend(),
    "counts": counts,
    "in_flight": in_flight,
    "errors": errors[:20],
    "num_errors": len(errors),
    "numels": seen_numels,
    "num_ooms": torch.cuda.memory_stats(device).get("num_ooms", 0),
}
reports = [None] * world_size
dist.all_gather_object(reports, report)
if rank == 0:
    emit({"mode": args.allocator, "world_size": world_size, "steps": args.steps, "ranks": reports})
dist.destroy_process_group()
