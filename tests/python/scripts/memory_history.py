"""Memory history under the allocator named by argv[1]: records with
stacks, allocates and frees (one free pending on a side stream), checks the
trace entries and frames of _snapshot(), dumps the snapshot, renders
memory_viz's HTML into argv[2], stops recording; records a record_function
region as an annotation; then an OOM with an observer attached."""

import os
import pickle
import sys

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])
out_dir = sys.argv[2]
torch.cuda.init()
MiB = 1 << 20
result = {}


def allocate_here():
    return torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")


torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
result["enabled"] = torch._C._cuda_isHistoryEnabled() if hasattr(torch._C, "_cuda_isHistoryEnabled") else None
kept = allocate_here()
freed = allocate_here()
freed_ptr = freed.data_ptr()
del freed
side = torch.cuda.Stream()
pending = allocate_here()
pending_ptr = pending.data_ptr()
with torch.cuda.stream(side):
    torch.cuda._sleep(1000000)
    pending.add_(1)
pending.record_stream(side)
del pending
torch.cuda.synchronize()
torch.empty(1, device="cuda")  # lets the pending free complete

snapshot = torch.cuda.memory._snapshot()
traces = snapshot["device_traces"][torch.cuda.current_device()]
actions = [t["action"] for t in traces]
result["actions"] = sorted(set(actions))
kept_allocs = [t for t in traces if t["action"] == "alloc" and t["addr"] == kept.data_ptr()]
result["kept_alloc_entries"] = len(kept_allocs)
result["kept_alloc_size"] = kept_allocs[-1]["size"] if kept_allocs else None
result["kept_alloc_has_this_file"] = bool(kept_allocs) and any(
    "memory_history.py" in f.get("filename", "") for f in kept_allocs[-1]["frames"]
)
result["freed_sequence"] = [t["action"] for t in traces if t["addr"] == freed_ptr and t["action"].startswith("free")]
result["pending_sequence"] = [t["action"] for t in traces if t["addr"] == pending_ptr and t["action"].startswith("free")]
result["has_segment_event"] = any(a in ("segment_alloc", "segment_map") for a in actions)
result["time_us_present"] = all("time_us" in t for t in traces)
block_frames = []
for segment in snapshot["segments"]:
    address = segment["address"]
    for block in segment["blocks"]:
        if address == kept.data_ptr():
            block_frames = block.get("frames", [])
        address += block["size"]
result["kept_block_has_this_file"] = any("memory_history.py" in f.get("filename", "") for f in block_frames)

dump = os.path.join(out_dir, "snapshot.pickle")
torch.cuda.memory._dump_snapshot(dump)
with open(dump, "rb") as f:
    loaded = pickle.load(f)
result["dump_has_traces"] = len(loaded["device_traces"][torch.cuda.current_device()]) > 0
from torch.cuda import _memory_viz

html = _memory_viz.trace_plot(loaded)
with open(os.path.join(out_dir, "trace_plot.html"), "w") as f:
    f.write(html)
result["trace_plot_bytes"] = len(html)
segment_html = _memory_viz.segment_plot(loaded)
result["segment_plot_bytes"] = len(segment_html)

torch.cuda.memory._record_memory_history(enabled=None)
result["traces_after_stop"] = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])

# record_function regions reach the snapshot as external annotations.
REGION = "streamalloc_annotated_region"
torch.cuda.memory._record_memory_history(max_entries=100000, global_record_annotations=True)
with torch.profiler.record_function(REGION):
    annotated = allocate_here()
del annotated
annotations = torch.cuda.memory._snapshot().get("external_annotations")
result["annotations_key"] = annotations is not None
ours = [a for a in annotations or [] if REGION in str(a)]
result["region_annotations"] = [{k: v for k, v in a.items() if "time" not in k} for a in ours]
result["region_annotations_timed"] = all(any("time" in k for k in a) for a in ours)
torch.cuda.memory._record_memory_history(enabled=None)
result["annotations_after_stop"] = len(torch.cuda.memory._snapshot().get("external_annotations") or [])

observed = []
torch._C._cuda_attach_out_of_memory_observer(lambda device, alloc, device_alloc, device_free: observed.append(alloc))
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    result["oom_raised"] = False
except torch.cuda.OutOfMemoryError as error:
    result["oom_raised"] = True
    result["oom_message"] = str(error)
result["observer_calls"] = len(observed)
emit(result)
