"""Caching off for a debugging run, one allocator per process (argv[1]:
native or streamalloc), with PYTORCH_NO_CUDA_MEMORY_CACHING as the test
sets it, or with torch.cuda.memory.caching_allocator_enable(False) when
argv[2] is "disable": a tensor is device memory of its own while it lives
and goes back to the driver when freed, outside the cache's statistics, as
under torch's own allocator; raw allocations and record_stream still
work."""

import sys

import torch

from _common import emit, select_allocator

mode = sys.argv[1]
select_allocator(mode)

MiB = 1 << 20
size = 256 * MiB


def device_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


torch.cuda.init()
if sys.argv[2:] == ["disable"]:
    torch.cuda.memory.caching_allocator_enable(False)
torch.ones(1, device="cuda")  # the context and torch's own first allocations
before = device_free()
tensor = torch.ones(size, dtype=torch.uint8, device="cuda")
while_live = device_free()
stats = torch.cuda.memory_stats()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    tensor.add_(1)
tensor.record_stream(side)
torch.cuda.current_stream().wait_stream(side)
total = tensor.sum().item()
# Measured around the free alone: the kernels above load their modules
# into device memory on first use.
before_free = device_free()
del tensor
after_free = device_free()
raw = torch.cuda.caching_allocator_alloc(MiB)
torch.cuda.caching_allocator_delete(raw)
emit(
    {
        "mode": mode,
        "backend": torch.cuda.memory.get_allocator_backend(),
        "taken_while_live": before - while_live,
        "back_after_free": after_free - before_free,
        "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
        "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "sum": total,
    }
)
