"""The rest of torch's allocator API under the allocator named by argv[1]:
the device-generic torch.accelerator memory functions, run-time settings
(torch.cuda.memory._set_allocator_settings), out-of-memory wording, memory
fraction 0, and caching_allocator_alloc/delete."""

import sys
import warnings

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])
torch.cuda.init()
MiB = 1 << 20
result = {}

# --- torch.accelerator reports the installed allocator's numbers
tensors = [torch.empty(5 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
result["accelerator_allocated"] = torch.accelerator.memory_allocated()
result["cuda_allocated"] = torch.cuda.memory_allocated()
acc_stats = torch.accelerator.memory_stats()
result["accelerator_active_bytes"] = acc_stats.get("active_bytes.all.current")
result["cuda_active_bytes"] = torch.cuda.memory_stats()["active_bytes.all.current"]
result["accelerator_reserved"] = torch.accelerator.memory_reserved()
result["cuda_reserved"] = torch.cuda.memory_reserved()
del tensors
torch.accelerator.reset_peak_memory_stats()
result["accelerator_peak_after_reset"] = torch.accelerator.max_memory_allocated()
result["cuda_peak_after_reset"] = torch.cuda.max_memory_allocated()
torch.accelerator.empty_cache()
result["reserved_after_accelerator_empty_cache"] = torch.cuda.memory_reserved()

# --- the cumulative counters through torch.accelerator, as torch's own
# test_accelerator.py reads them: one 1 KiB tensor after a reset (a first
# randn, freed and the cache emptied, as in that test)
warm = torch.randn(100, device="cuda")
del warm
torch.accelerator.empty_cache()
torch.accelerator.reset_accumulated_memory_stats()
active_before = torch.accelerator.memory_stats()["active_bytes.all.current"]
reserved_before = torch.accelerator.memory_reserved()
kib = torch.randn(256, device="cuda")
live = torch.accelerator.memory_stats()
result["kib_active_rise"] = live["active_bytes.all.current"] - active_before
result["kib_active_freed_while_live"] = live["active_bytes.all.freed"]
del kib
torch.accelerator.empty_cache()
after = torch.accelerator.memory_stats()
result["kib_active_rise_after_free"] = after["active_bytes.all.current"] - active_before
result["kib_active_freed"] = after["active_bytes.all.freed"]
result["kib_allocated_freed"] = after["allocated_bytes.all.freed"]
result["kib_reserved_back"] = torch.accelerator.memory_reserved() == reserved_before

# --- run-time settings
torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")
result["max_split_size"] = torch.cuda.memory_stats()["max_split_size"]
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
before = torch.cuda.memory_allocated()
odd = torch.empty(1100 * 1024 + 7, dtype=torch.uint8, device="cuda")
result["rounded_bytes"] = torch.cuda.memory_allocated() - before
del odd
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:1,max_split_size_mb:2048")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.memory._set_allocator_settings("release_lock_on_cudamalloc:True")
result["ignored_key_warnings"] = [str(w.message) for w in caught]

# --- torch's own errors keep their Python types with streamalloc loaded
def error_type(call):
    try:
        call()
    except Exception as error:  # the type is the result
        return type(error).__name__
    return None


result["unknown_key_error"] = error_type(lambda: torch._C._accelerator_setAllocatorSettings("foo:1,bar:2"))
result["bad_fraction_error"] = error_type(lambda: torch.cuda.set_per_process_memory_fraction(1))
result["bad_index_error"] = error_type(lambda: torch.cuda.memory_stats(device=1000))

# --- OOM wording and fraction 0
try:
    torch.empty(1024 * 1024 * 1024 * 800000000, dtype=torch.int8, device="cuda")
except torch.cuda.OutOfMemoryError as error:
    result["huge_oom"] = str(error)
torch.cuda.set_per_process_memory_fraction(0.0)
try:
    torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    result["fraction0_raised"] = False
except torch.cuda.OutOfMemoryError as error:
    result["fraction0_raised"] = True
    result["fraction0_message"] = str(error)
torch.cuda.set_per_process_memory_fraction(1.0)
result["after_fraction_restore_ok"] = torch.ones(4 * MiB, device="cuda").sum().item() == 4 * MiB

# --- caching_allocator_alloc / delete (raw_alloc_with_stream / raw_delete)
before = torch.cuda.memory_allocated()
ptr = torch.cuda.caching_allocator_alloc(3 * MiB, stream=torch.cuda.current_stream())
result["raw_alloc_delta"] = torch.cuda.memory_allocated() - before
torch.cuda.caching_allocator_delete(ptr)
result["raw_delete_delta"] = torch.cuda.memory_allocated() - before
emit(result)
