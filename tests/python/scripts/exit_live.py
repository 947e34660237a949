"""Exits with streamalloc memory still in use: live tensors, a pending free
still waiting on a side stream, and a CUDA graph with its private pool.
Interpreter and static teardown then free them in whatever order they
choose; the process must still exit cleanly."""

import torch

import streamalloc
from _common import emit

streamalloc.install()

live = [torch.randn(1 << 20, device="cuda") for _ in range(4)]

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
pending = torch.ones(1 << 20, device="cuda")
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)
    pending.mul_(3)
pending.record_stream(side)
del pending

static_x = torch.zeros(256, device="cuda")
warmup = torch.cuda.Stream()
warmup.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(warmup):
    static_x * 2
torch.cuda.current_stream().wait_stream(warmup)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_y = static_x * 2
graph.replay()

emit({"live_tensors": len(live), "graph_output": static_y.shape[0]})
