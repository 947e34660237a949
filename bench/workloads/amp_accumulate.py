"""Workload for trace capture: fp16 mixed-precision training with
torch.amp.GradScaler and gradient accumulation, the loop of many
fine-tuning scripts: a deep residual MLP (48 blocks, 1024 wide, about 400M
fp32 parameters in 290 tensors), four micro-batches of 512..8192 tokens
each before every optimizer step, then unscale_, clip_grad_norm_ and
AdamW with foreach kernels over every tensor, and the scaler's update.
About 16 s under scripts/capture_trace.py on an H200:

    python scripts/capture_trace.py -o amp_accumulate.trace.csv.gz -- bench/workloads/amp_accumulate.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class residual_mlp(nn.Module):
    def __init__(self, width, blocks, classes):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main():
    p = _workload.parser(__doc__, steps=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8192)
    args = p.parse_args()
    if args.tiny:
        args.width, args.blocks, args.min_tokens, args.max_tokens = 32, 3, 8, 64
    w = _workload.run("amp_accumulate", args)

    classes = 1000
    model = residual_mlp(args.width, args.blocks, classes).to(w.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    scaler = torch.amp.GradScaler(w.device.type, enabled=w.cuda)
    tokens = 0
    for _ in range(args.steps):
        for _ in range(args.micro_batches):
            n = w.randint(args.min_tokens, args.max_tokens)
            x = torch.randn(n, args.width, device=w.device)
            y = torch.randint(0, classes, (n,), device=w.device)
            with torch.autocast(w.device.type, dtype=torch.float16, enabled=w.cuda):
                loss = F.cross_entropy(model(x).float(), y) / args.micro_batches
            scaler.scale(loss).backward()
            tokens += n
            del x, y, loss
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    w.finish(f"{args.steps} steps, {tokens} tokens")


if __name__ == "__main__":
    main()
