"""Workload for trace capture: training with the optimizer's state on the
host, as ZeRO-Offload style trainers do when Adam's moments do not fit:
GPT-2 medium (bench/workloads/gpt2_model.py, about 350M parameters) whose
fp32 master weights and Adam moments live in host memory. Every step runs
forward and backward on the GPU at a random sequence length, copies each
gradient into pinned host memory on a side stream as soon as the backward
pass has made it (a hook per parameter; Tensor.record_stream on the
gradient, which is dropped at once), steps Adam on the CPU, and copies
the new weights back on another side stream that the compute stream then
waits for. About 30-60 s on an H200:

    python scripts/capture_trace.py -o optimizer_offload_train.trace.csv.gz -- \\
        bench/workloads/optimizer_offload_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt2_model import gpt2, gpt2_config  # noqa: E402


def main():
    p = _workload.parser(__doc__, steps=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 8, 32
    w = _workload.run("optimizer_offload_train", args)

    if args.tiny:
        config = gpt2_config(vocab_size=256, n_ctx=64, n_embd=32, n_layer=2, n_head=2)
    else:
        config = gpt2_config(n_embd=1024, n_layer=24, n_head=16)
    model = gpt2(config).to(w.device)
    params = [p for p in model.parameters() if p.requires_grad]
    master = [w.pinned_empty(p.shape, torch.float32).copy_(p.detach()) for p in params]
    grads = [w.pinned_empty(p.shape, torch.float32) for p in params]
    optimizer = torch.optim.Adam(master, lr=1e-4)
    download, upload = w.stream(), w.stream()
    compute = w.current_stream()

    def offload(i):
        def hook(param):
            g = param.grad
            w.wait(download, compute)
            with w.on(download):
                grads[i].copy_(g, non_blocking=True)
            w.record(g, download)
            param.grad = None
        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(offload(i))

    tokens = 0
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        ids = torch.randint(0, config.vocab_size, (args.batch, length + 1), device=w.device)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        del logits
        loss.backward()
        if download is not None:
            download.synchronize()
        for m, g in zip(master, grads):
            m.grad = g
        optimizer.step()
        w.wait(upload, compute)
        with w.on(upload):
            for p, m in zip(params, master):
                p.data.copy_(m, non_blocking=True)
        w.wait(compute, upload)
        tokens += args.batch * length
        del ids
    w.finish(f"{args.steps} steps, {tokens} tokens, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
