"""A block freed inside a CUDA graph capture while a forked capture stream
still reads it (record_stream), under the allocator named by argv[1] and
with torch's graph_capture_record_stream_reuse setting argv[2] (True or
False): whether allocations on the capturing stream get the block back
before and after the fork is joined, and the graph's result."""

import sys

import torch

from _common import emit, select_allocator

select_allocator(sys.argv[1])
torch.cuda.memory._set_allocator_settings(f"graph_capture_record_stream_reuse:{sys.argv[2]}")
main, side = torch.cuda.Stream(), torch.cuda.Stream()
graph = torch.cuda.CUDAGraph(keep_graph=True)
torch.cuda.synchronize()
with torch.cuda.stream(main):
    graph.capture_begin()
    out = torch.zeros(64, device="cuda")
    source = torch.full((64,), 3.0, device="cuda")
    source_ptr = source.data_ptr()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        doubled = source * 2
        source.record_stream(side)
    del source
    before_join = torch.empty(64, device="cuda")
    before_join_ptr = before_join.data_ptr()
    main.wait_stream(side)
    out.add_(doubled)
    after_join = torch.empty(64, device="cuda")
    after_join_ptr = after_join.data_ptr()
    after_join.fill_(1.0)
    out.add_(after_join)
    graph.capture_end()
graph.replay()
torch.cuda.synchronize()
emit({
    "reused_before_join": before_join_ptr == source_ptr,
    "reused_after_join": after_join_ptr == source_ptr,
    "out_sum": out.sum().item(),
})
