"""Kernels that lean on the allocator, under streamalloc: cudnn.benchmark
convolutions (their workspace search asks cacheInfo), CUDA graph capture
and replay (private pools), and make_graphed_callables. Results are
compared with references computed outside the mechanism under test."""

import copy
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F

import streamalloc
from _common import emit

streamalloc.install()
torch.manual_seed(0)
result = {}


def relative_error(value, reference):
    value, reference = value.double().cpu(), reference.double().cpu()
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


# --- cudnn.benchmark convolution vs float64 on the CPU ------------------------
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = False
convolutions = []
for batch, channels, out_channels, size, kernel, stride in ((8, 16, 32, 32, 3, 1), (4, 64, 64, 56, 3, 2), (2, 3, 16, 64, 7, 2)):
    x = torch.randn(batch, channels, size, size, dtype=torch.float64)
    w = torch.randn(out_channels, channels, kernel, kernel, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    ref = F.conv2d(x_ref, w, stride=stride, padding=kernel // 2)
    ref.sum().backward()
    x_gpu = x.float().cuda().requires_grad_()
    out = F.conv2d(x_gpu, w.float().cuda(), stride=stride, padding=kernel // 2)
    out.sum().backward()
    convolutions.append(
        {"forward_error": relative_error(out, ref), "input_grad_error": relative_error(x_gpu.grad, x_ref.grad)}
    )
result["cudnn_benchmark"] = {"enabled": torch.backends.cudnn.benchmark, "convolutions": convolutions}
torch.backends.cudnn.benchmark = False


def private_pools():
    """Bytes per private pool id, from streamalloc's snapshot."""
    pools = {}
    for segment in streamalloc.snapshot()["segments"]:
        pool = tuple(segment["segment_pool_id"])
        if pool != (0, 0):
            pools[str(pool)] = pools.get(str(pool), 0) + segment["total_size"]
    return pools


# --- CUDA graph capture and replay -------------------------------------------
# cuBLAS keeps a workspace per stream, made by the stream's first matmul and
# kept for the life of the process. Warming the capture stream before any
# capture keeps those workspaces out of the graphs' private pools, so that
# deleting a graph must give all of its pool back. Every capture below,
# make_graphed_callables' included, uses this stream.
capture_stream = torch.cuda.Stream()
torch.cuda.graph.default_capture_stream = capture_stream
weight = torch.randn(1024, 1024, device="cuda")
static_x = torch.zeros(64, 1024, device="cuda")


def step(inp):
    return torch.relu(inp @ weight) * 2 + 1


capture_stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(capture_stream):
    for _ in range(3):
        step(static_x)
torch.cuda.current_stream().wait_stream(capture_stream)

graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = step(static_x)
pools_with_graph = private_pools()

replay_errors = []
for _ in range(3):
    data = torch.randn(64, 1024, device="cuda")
    static_x.copy_(data)
    graph.replay()
    torch.cuda.synchronize()
    replay_errors.append(relative_error(static_y, step(data)))

del graph, static_y
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
result["graph"] = {
    "pools_with_graph": pools_with_graph,
    "replay_errors": replay_errors,
    "pools_after_delete": private_pools(),
}

# --- make_graphed_callables --------------------------------------------------
def run_graphed_callables(iterations=3):
    """Graphed forward/backward vs an eager copy of the module; returns the
    worst relative error per iteration and the private pools in use."""
    module = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    reference = copy.deepcopy(module)
    sample = torch.randn(32, 256, device="cuda", requires_grad=True)
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        module(sample).sum().backward()
    torch.cuda.current_stream().wait_stream(capture_stream)
    sample.grad = None
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    worst = []
    for _ in range(iterations):
        x = torch.randn(32, 256, device="cuda", requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        for p in list(graphed.parameters()) + list(reference.parameters()):
            p.grad = None
        out = graphed(x)
        out.sum().backward()
        ref_out = reference(x_ref)
        ref_out.sum().backward()
        errors = [relative_error(out, ref_out), relative_error(x.grad, x_ref.grad)]
        errors += [relative_error(p.grad, q.grad) for p, q in zip(graphed.parameters(), reference.parameters())]
        worst.append(max(errors))
    return worst, private_pools()


graphed_errors, pools_with_callables = run_graphed_callables()
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
result["graphed_callables"] = {
    "errors": graphed_errors,
    "pools_while_alive": pools_with_callables,
    "pools_after_delete": private_pools(),
}
emit(result)
