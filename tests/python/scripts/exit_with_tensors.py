"""Exits with CUDA memory from streamalloc still live, the way scripts end:
tensors in globals, in a reference cycle only the collector frees, in an
autograd graph never backpropagated, a pending free on a side stream, a
CUDA graph holding its private pool, and an allocation made by an atexit
handler. argv[1] is `empty_cache` (empty
the cache first, as some scripts do) or `keep`. The process must exit 0
with nothing on stderr about failed frees or crashes."""

import atexit
import sys

import torch

import streamalloc
from _common import emit

streamalloc.install()
mode = sys.argv[1]
if mode not in ("empty_cache", "keep"):
    sys.exit(f"unknown mode {mode!r} (expected empty_cache or keep)")

live = [torch.randn(1 << 20, device="cuda") for _ in range(3)]
by_name = {"big": torch.empty(64 << 20, dtype=torch.uint8, device="cuda")}


class Node:
    def __init__(self):
        self.tensor = torch.zeros(1 << 16, device="cuda")
        self.other = self


cycle = Node()

w = torch.randn(256, 256, device="cuda", requires_grad=True)
never_backpropagated = (w @ w).relu().sum()

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
pending = torch.ones(1 << 20, device="cuda")
with torch.cuda.stream(side):
    torch.cuda._sleep(50_000_000)
    pending.mul_(2)
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

freed = torch.randn(8 << 20, device="cuda")
del freed  # cached, not live

atexit.register(lambda: torch.ones(1024, device="cuda").sum().item())

if mode == "empty_cache":
    torch.cuda.empty_cache()

emit({"mode": mode, "live": len(live) + len(by_name), "graph_output": static_y.shape[0],
      "allocator": torch.cuda.memory.get_allocator_backend()})
