"""The plain path, without streamalloc's extension: torch's own
CUDAPluggableAllocator loads libstreamalloc.so's C entry points. Checks a
computation, and that freed memory stays cached in streamalloc until its
streamalloc_empty_cache() hands it back to the driver."""

import ctypes

import torch

import streamalloc
from _common import emit

path = streamalloc.library_path()
allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "streamalloc_malloc", "streamalloc_free")
torch.cuda.memory.change_current_allocator(allocator)

generator = torch.Generator().manual_seed(0)
a = torch.randn(512, 512, dtype=torch.float64, generator=generator)
b = torch.randn(512, 512, dtype=torch.float64, generator=generator)
product = (a.cuda() @ b.cuda()).cpu()
error = ((product - a @ b).abs().max() / (a @ b).abs().max()).item()

GiB = 1 << 30
block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
del block
torch.cuda.synchronize()
free_cached = torch.cuda.mem_get_info()[0]
library = ctypes.CDLL(path)
library.streamalloc_empty_cache.argtypes = [ctypes.c_int]
library.streamalloc_empty_cache.restype = ctypes.c_int
status = library.streamalloc_empty_cache(-1)
free_released = torch.cuda.mem_get_info()[0]

emit(
    {
        "library": path,
        "backend": torch.cuda.memory.get_allocator_backend(),
        "relative_error": error,
        "empty_cache_status": status,
        "released_bytes": free_released - free_cached,
    }
)
