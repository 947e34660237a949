"""Memory limits under streamalloc: the per-process memory fraction, running
out of device memory (the error, and that the process and its memory stay
usable afterwards), and empty_cache handing memory back to the driver."""

import torch

import streamalloc
from _common import emit

streamalloc.install()

GiB = 1 << 30
total = torch.cuda.get_device_properties(0).total_memory
result = {"total": total}


def bytes_tensor(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")


def try_allocate(n):
    """(tensor, None) or (None, error description) for an n-byte tensor."""
    try:
        return bytes_tensor(n), None
    except torch.cuda.OutOfMemoryError as error:
        return None, {"type": type(error).__name__, "is_runtime_error": isinstance(error, RuntimeError), "message": str(error)}


# --- memory fraction ---------------------------------------------------------
fraction = 0.05
torch.cuda.set_per_process_memory_fraction(fraction)
first, first_error = try_allocate(int(0.03 * total))
second, second_error = try_allocate(int(0.03 * total))
del first
# The cached 3% block is too small; releasing it makes room under the cap.
third, third_error = try_allocate(int(0.04 * total))
result["fraction"] = {
    "fraction": fraction,
    "reported": torch.cuda.get_per_process_memory_fraction(),
    "first_error": first_error,
    "second_error": second_error,
    "third_error": third_error,
    "reserved_with_third": torch.cuda.memory_reserved(),
}
del second, third
torch.cuda.set_per_process_memory_fraction(1.0)
torch.cuda.empty_cache()

# --- out of memory -------------------------------------------------------------
_, huge_error = try_allocate(2 * total)
chunks, fill_error = [], None
for _ in range(total // GiB + 4):
    chunk, fill_error = try_allocate(GiB)
    if chunk is None:
        break
    chunks.append(chunk)
filled = len(chunks)
del chunks
device_allocs_before = streamalloc.stats()["num_device_alloc"]
again = [bytes_tensor(GiB) for _ in range(filled)]
reused_without_new_segments = streamalloc.stats()["num_device_alloc"] == device_allocs_before
del again
computed = (torch.ones(1000, device="cuda") * 2).sum().item()
result["oom"] = {
    "huge_error": huge_error,
    "fill_error": fill_error,
    "filled_chunks": filled,
    "reallocated_from_cache": reused_without_new_segments,
    "num_ooms": torch.cuda.memory_stats()["num_ooms"],
    "computed_after": computed,
}

# --- empty_cache ---------------------------------------------------------------
reserved_before = torch.cuda.memory_reserved()
free_before = torch.cuda.mem_get_info()[0]
torch.cuda.empty_cache()
free_after = torch.cuda.mem_get_info()[0]
reserved_after = torch.cuda.memory_reserved()

block = bytes_tensor(2 * GiB)
del block
reserved_cached = torch.cuda.memory_reserved()
streamalloc.empty_cache()
result["empty_cache"] = {
    "reserved_before": reserved_before,
    "reserved_after": reserved_after,
    "free_before": free_before,
    "free_after": free_after,
    "streamalloc_reserved_cached": reserved_cached,
    "streamalloc_reserved_after": torch.cuda.memory_reserved(),
}
emit(result)
