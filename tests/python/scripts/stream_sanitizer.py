"""torch's GPU trace under the allocator named by argv[1]: which
allocations and frees the callbacks of torch.cuda._gpu_trace hear, and
what the CUDA Stream Sanitizer (torch.cuda._sanitizer, which listens to
them) says of a block reused after record_stream (no race: the allocator
waited for the side stream) and of a real race."""

import sys
import time

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])

import torch.cuda._gpu_trace as gpu_trace  # noqa: E402
from torch.cuda import _sanitizer as sanitizer  # noqa: E402

heard_allocations, heard_frees = [], []
torch._C._activate_gpu_trace()
gpu_trace.register_callback_for_memory_allocation(heard_allocations.append)
gpu_trace.register_callback_for_memory_deallocation(heard_frees.append)
tensors = [torch.empty(n, device="cuda") for n in (1, 1000, 1 << 18, 3 << 20)]
pointers = [t.data_ptr() for t in tensors]
del tensors
raw = torch.cuda.caching_allocator_alloc(1 << 20)
torch.cuda.caching_allocator_delete(raw)
pointers.append(raw)
trace = {
    "allocations_heard": [p in heard_allocations for p in pointers],
    "frees_heard": [p in heard_frees for p in pointers],
    "allocation_count": len(heard_allocations),
    "free_count": len(heard_frees),
}

torch.cuda.synchronize()
torch.cuda.empty_cache()
sanitizer.enable_cuda_sanitizer()
side = torch.cuda.Stream()
x = torch.ones(1 << 20, device="cuda")
x_pointer = x.data_ptr()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    doubled = x * 2
x.record_stream(side)
del x
side_done = torch.cuda.Event()
side_done.record(side)
while not side_done.query():  # not a synchronization the sanitizer hears
    time.sleep(0.001)
reuse = torch.empty(1 << 20, device="cuda")
reused = reuse.data_ptr() == x_pointer
try:
    reuse.fill_(3.0)
    reuse_reported = None
except sanitizer.CUDASanitizerErrors as errors:
    reuse_reported = str(errors)

racing = torch.rand(1 << 10, device="cuda")
try:
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.mul(racing, 5, out=racing)
    race_reported = False
except sanitizer.CUDASanitizerErrors:
    race_reported = True

emit({**trace, "reused": reused, "reuse_reported": reuse_reported, "race_reported": race_reported})
