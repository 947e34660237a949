"""Workload for trace capture: batch inference as a three-stream pipeline,
as data-loading and serving loops overlap copies with compute. Each batch
(4..64 images of a new side in 160..384, steps of 32) is uploaded from
pinned host memory on a copy-in stream while the previous batches run, a
torchvision ResNet-50 (random weights, bf16, channels_last) classifies it
on the compute stream, and its logits and top-5 classes go back to pinned
host memory on a copy-out stream. Up to three batches are in flight; each
stream's tensors that another stream reads are kept by record_stream, and
the host waits for a batch only when it collects the batch's results.
About 10-20 s on an H200:

    python scripts/capture_trace.py -o stream_pipeline_infer.trace.csv.gz -- \\
        bench/workloads/stream_pipeline_infer.py
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402


def main():
    p = _workload.parser(__doc__, steps=60)
    p.add_argument("--min-batch", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--min-side", type=int, default=160)
    p.add_argument("--max-side", type=int, default=384)
    p.add_argument("--in-flight", type=int, default=3)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch, args.min_side, args.max_side = 1, 3, 32, 64
    w = _workload.run("stream_pipeline_infer", args)

    model = torchvision.models.resnet50(weights=None).to(device=w.device, dtype=w.dtype()).eval()
    if w.cuda:
        model = model.to(memory_format=torch.channels_last)
    copy_in, compute, copy_out = w.stream(), w.current_stream(), w.stream()
    sides = range(args.min_side, args.max_side + 1, 32)
    pending = collections.deque()  # (event or None, host logits, host top-5)
    images_done = 0

    def collect():
        done, logits, _ = pending.popleft()
        if done is not None:
            done.synchronize()
        return logits.shape[0]

    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(args.min_batch, args.max_batch)
            side = w.choice(sides)
            host = w.pinned_empty((batch, 3, side, side), w.dtype())
            host.normal_()
            with w.on(copy_in):
                images = host.to(w.device, non_blocking=True)
            w.wait(compute, copy_in)
            w.record(images, compute)
            if w.cuda:
                images = images.contiguous(memory_format=torch.channels_last)
            logits = model(images)
            top5 = logits.topk(5, dim=1).indices
            del images
            w.wait(copy_out, compute)
            w.record(logits, copy_out)
            w.record(top5, copy_out)
            with w.on(copy_out):
                host_logits = w.pinned_empty(logits.shape, logits.dtype)
                host_top5 = w.pinned_empty(top5.shape, top5.dtype)
                host_logits.copy_(logits, non_blocking=True)
                host_top5.copy_(top5, non_blocking=True)
                done = torch.cuda.Event() if w.cuda else None
                if done is not None:
                    done.record(copy_out)
            del logits, top5
            pending.append((done, host_logits, host_top5))
            if len(pending) >= args.in_flight:
                images_done += collect()
        while pending:
            images_done += collect()
    w.finish(f"{args.steps} batches, {images_done} images classified")


if __name__ == "__main__":
    main()
