"""torch.compile(mode="reduce-overhead") (CUDA graph trees) under the
allocator named by argv[1]: a training and an inference loop of a small MLP,
then one compiled function called with several input shapes, so its graphs
form several branches of one tree sharing one memory pool. Reports the
results (to compare with torch's native allocator), how often graph trees
used the allocator's checkpoint and pool-liveness calls, and whether the
pool's segments are expandable (they are under
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."""

import sys

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# Graph trees check every pool's live allocations against the tensors they
# expect (checkPoolLiveAllocations) when these asserts are on.
torch._inductor.config.triton.slow_path_cudagraph_asserts = True

calls = {"getCheckpointState": 0, "setCheckpointPoolState": 0, "checkPoolLiveAllocations": 0}


def counted(name):
    original = getattr(torch._C, "_cuda_" + name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    setattr(torch._C, "_cuda_" + name, wrapper)


for name in calls:
    counted(name)

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs = [torch.randn(32, 64, device="cuda") for _ in range(8)]


# The model's forward and the backward AOTAutograd derives from it run as
# CUDA graphs; the loss and the optimizer run eagerly, as in a user's loop.
compiled_model = torch.compile(model, mode="reduce-overhead")
train_losses = []
for x in inputs:
    # Each call is a new step whose outputs may overwrite the last step's.
    torch.compiler.cudagraph_mark_step_begin()
    loss = compiled_model(x).square().mean()
    loss.backward()
    train_losses.append(loss.item())
    optimizer.step()
    # Gradients are outputs of the backward graph, overwritten by its next
    # replay: set to None, the next backward gives fresh ones instead of
    # accumulating into the old buffers.
    optimizer.zero_grad(set_to_none=True)

model.eval()
compiled_infer = torch.compile(model, mode="reduce-overhead")
with torch.no_grad():
    infer_sums = []
    for x in inputs:
        torch.compiler.cudagraph_mark_step_begin()
        infer_sums.append(compiled_infer(x).sum().item())

weight = torch.randn(64, 64, device="cuda")


def branchy(x):
    y = (x @ weight).relu()
    return y.sum(dim=0) + y.mean()


compiled_branchy = torch.compile(branchy, mode="reduce-overhead", dynamic=False)
branch_sums = []
for repeat in range(4):
    for rows in (8, 16, 24):
        torch.compiler.cudagraph_mark_step_begin()
        branch_sums.append(compiled_branchy(torch.ones(rows, 64, device="cuda") * (repeat + 1)).sum().item())

torch.cuda.synchronize()
private = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) != (0, 0)]
emit({
    "train_losses": train_losses,
    "infer_sums": infer_sums,
    "branch_sums": branch_sums,
    "calls": calls,
    "backend_name": torch.cuda.memory.get_allocator_backend(),
    # Whether the graph trees' pool grew expandable segments (PYTORCH_CUDA_ALLOC_CONF).
    "private_segments": len(private),
    "private_expandable": [bool(seg["is_expandable"]) for seg in private],
})
