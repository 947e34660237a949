"""One process, two GPUs, streamalloc installed: tensors on cuda:0 and
cuda:1, peer copies both ways (contiguous and strided), and after every
phase each device's streamalloc.stats(d) and torch.cuda.memory_stats(d)
agree with each other and with that device's own live bytes. Emptying the
cache leaves only segments that hold live tensors. Needs two visible GPUs."""

import sys

import torch

import streamalloc
from _common import emit

streamalloc.install()

if torch.cuda.device_count() < 2:
    sys.exit(f"two_devices.py needs 2 GPUs; torch sees {torch.cuda.device_count()}")

DEVICES = (0, 1)
# Every size is a multiple of 512 bytes (128 float32), the smallest block,
# so allocated bytes equal the tensors' bytes exactly.
# The third tensor of each device is also copied through a strided view of
# rows of 256 floats, so its size is a multiple of 256 floats.
SIZES = {0: (128, 256 * 1024, 3 * 256 * 1024 + 256, 16 * 1024), 1: (7 * 128, 512 * 1024, 5 * 1024 * 1024 + 1024, 4096)}
KEYS = (
    "allocated_bytes.all.current",
    "requested_bytes.all.current",
    "reserved_bytes.all.current",
    "allocation.all.current",
    "segment.all.current",
    "allocated_bytes.all.peak",
)

errors = []
live = {d: [] for d in DEVICES}  # (tensor, expected values on the CPU)


def pattern(numel, offset):
    return torch.arange(numel, dtype=torch.float32).remainder_(1009).add_(offset)


def make(device, numel, offset):
    tensor = torch.arange(numel, dtype=torch.float32, device=f"cuda:{device}").remainder_(1009).add_(offset)
    return tensor, pattern(numel, offset)


def live_bytes(device):
    return sum(t.untyped_storage().nbytes() for t, _ in live[device])


def check_values(phase):
    for device in DEVICES:
        for tensor, expected in live[device]:
            if tensor.device != torch.device("cuda", device):
                errors.append(f"{phase}: a tensor meant for cuda:{device} is on {tensor.device}")
            elif not torch.equal(tensor.cpu(), expected):
                errors.append(f"{phase}: a tensor on cuda:{device} ({tensor.numel()} floats) lost its values")


def view(device):
    """Both interfaces' numbers for `device`, after its work has finished."""
    torch.cuda.synchronize(device)
    ours = streamalloc.stats(device)
    torch_view = torch.cuda.memory_stats(device)
    return {key: {"streamalloc": ours[key], "torch": torch_view[key]} for key in KEYS}


def check_stats(phase):
    """Each device's stats match between the two interfaces and count that
    device's live tensors, and nothing of the other's."""
    for device in DEVICES:
        numbers = view(device)
        for key, pair in numbers.items():
            if pair["streamalloc"] != pair["torch"]:
                errors.append(f"{phase}: cuda:{device} {key}: streamalloc.stats says {pair['streamalloc']}, "
                              f"torch.cuda.memory_stats says {pair['torch']}")
        want = live_bytes(device)
        for key in ("allocated_bytes.all.current", "requested_bytes.all.current"):
            if numbers[key]["torch"] != want:
                errors.append(f"{phase}: cuda:{device} {key} is {numbers[key]['torch']}, live tensors hold {want}")
        if numbers["allocation.all.current"]["torch"] != len(live[device]):
            errors.append(f"{phase}: cuda:{device} counts {numbers['allocation.all.current']['torch']} allocations, "
                          f"{len(live[device])} tensors are live")
        if torch.cuda.memory_allocated(device) != want:
            errors.append(f"{phase}: torch.cuda.memory_allocated({device}) is {torch.cuda.memory_allocated(device)}, "
                          f"live tensors hold {want}")
        if numbers["reserved_bytes.all.current"]["torch"] < want:
            errors.append(f"{phase}: cuda:{device} reserves less than its live tensors")


def segments_by_device():
    """Device -> [(start, end)] of streamalloc's segments, from the
    all-device snapshot; also checks each per-device snapshot matches it."""
    found = {d: [] for d in DEVICES}
    for segment in streamalloc.snapshot()["segments"]:
        found.setdefault(segment["device"], []).append((segment["address"], segment["address"] + segment["total_size"]))
    for device in DEVICES:
        own = streamalloc.snapshot(device)["segments"]
        if any(segment["device"] != device for segment in own):
            errors.append(f"streamalloc.snapshot({device}) lists another device's segments")
        if sorted((s["address"], s["address"] + s["total_size"]) for s in own) != sorted(found[device]):
            errors.append(f"streamalloc.snapshot({device}) differs from the all-device snapshot's cuda:{device} part")
    return found


def check_placement(phase):
    """Every live tensor lies in a segment of its own device and in none of
    the other's."""
    segments = segments_by_device()
    for device in DEVICES:
        for tensor, _ in live[device]:
            pointer = tensor.untyped_storage().data_ptr()
            owners = [d for d in DEVICES if any(start <= pointer < end for start, end in segments[d])]
            if owners != [device]:
                errors.append(f"{phase}: a cuda:{device} tensor at {pointer:#x} lies in segments of devices {owners}")


baseline = {d: view(d) for d in DEVICES}
for device in DEVICES:
    if baseline[device]["allocated_bytes.all.current"]["torch"] != 0:
        errors.append(f"start: cuda:{device} already has allocated bytes")

# Device 0 first, with device 1 untouched: its numbers must stay zero.
for i, numel in enumerate(SIZES[0]):
    live[0].append(make(0, numel, 100 * i))
check_stats("cuda:0 only")
cuda1_while_cuda0_allocates = view(1)
cuda0_before = view(0)

# Device 1 reached both by an explicit index and as the current device.
for i, numel in enumerate(SIZES[1][:2]):
    live[1].append(make(1, numel, 10_000 + 100 * i))
with torch.cuda.device(1):
    for i, numel in enumerate(SIZES[1][2:]):
        tensor = torch.arange(numel, dtype=torch.float32, device="cuda").remainder_(1009).add_(20_000 + 100 * i)
        live[1].append((tensor, pattern(numel, 20_000 + 100 * i)))
check_stats("both devices")
check_placement("both devices")
if view(0) != cuda0_before:
    errors.append("cuda:0's numbers changed while only cuda:1 allocated")

# Peer copies both ways, contiguous (a device-to-device memcpy) and strided
# (a copy kernel or staging through temporaries, which must be freed again).
for source_device, target_device in ((0, 1), (1, 0)):
    for tensor, expected in list(live[source_device]):
        copied = tensor.to(f"cuda:{target_device}")
        live[target_device].append((copied, expected.clone()))
        # Same shape as the source: the second pass also copies the 2-D
        # result of the first pass's strided copy.
        into = torch.empty(tensor.shape, dtype=torch.float32, device=f"cuda:{target_device}")
        into.copy_(tensor, non_blocking=True)
        live[target_device].append((into, expected.clone()))
    source, expected = live[source_device][2]
    strided = source.view(-1, 256)[:, ::2]
    copied = strided.to(f"cuda:{target_device}")
    if not copied.is_contiguous():
        errors.append("a strided peer copy did not produce a contiguous tensor")
    live[target_device].append((copied, expected.view(-1, 256)[:, ::2].contiguous()))
for device in DEVICES:
    torch.cuda.synchronize(device)
check_values("after peer copies")
check_stats("after peer copies")
check_placement("after peer copies")

# Peaks are per device: resetting one leaves the other's alone.
peak0_before = torch.cuda.max_memory_allocated(0)
torch.cuda.reset_peak_memory_stats(1)
if torch.cuda.max_memory_allocated(0) != peak0_before:
    errors.append("resetting cuda:1's peak changed cuda:0's")
if torch.cuda.max_memory_allocated(1) != live_bytes(1):
    errors.append(f"cuda:1's peak after its reset is {torch.cuda.max_memory_allocated(1)}, not its live bytes")

# Freeing everything on cuda:1 and emptying the cache from it: cuda:1 keeps
# nothing, cuda:0 keeps only segments that hold its live tensors.
live[1].clear()
check_stats("cuda:1 freed")
reserved1_cached = torch.cuda.memory_reserved(1)
with torch.cuda.device(1):
    torch.cuda.empty_cache()
check_values("cuda:1 emptied")
check_stats("cuda:1 emptied")
check_placement("cuda:1 emptied")
reserved_after_empty = {d: torch.cuda.memory_reserved(d) for d in DEVICES}
if reserved_after_empty[1] != 0:
    errors.append(f"cuda:1 still reserves {reserved_after_empty[1]} bytes after empty_cache with no live tensors")
for segment in streamalloc.snapshot(0)["segments"]:
    if segment["allocated_size"] == 0:
        errors.append(f"cuda:0 kept an unused segment of {segment['total_size']} bytes through empty_cache")

live[0].clear()
check_stats("cuda:0 freed")
streamalloc.empty_cache()
reserved_at_end = {d: torch.cuda.memory_reserved(d) for d in DEVICES}
for device in DEVICES:
    if reserved_at_end[device] != 0:
        errors.append(f"cuda:{device} still reserves {reserved_at_end[device]} bytes at the end")

emit(
    {
        "allocator": torch.cuda.memory.get_allocator_backend(),
        "devices": torch.cuda.device_count(),
        "errors": errors[:40],
        "cuda1_while_cuda0_allocates": cuda1_while_cuda0_allocates,
        "reserved_cuda1_before_empty": reserved1_cached,
        "reserved_after_empty": reserved_after_empty,
        "reserved_at_end": reserved_at_end,
    }
)
