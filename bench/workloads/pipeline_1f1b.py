"""Workload for trace capture: a pipeline-parallel 1F1B schedule run on one
GPU. A 16-layer transformer (1024 wide) is cut into 4 stages; each step
splits its batch into 8 micro-batches that go through the stages in the
order Megatron's 1F1B schedule gives each stage (warm-up forwards, then one
forward one backward, then the remaining backwards), ticked stage by stage.
Every stage stashes the activations of its micro-batches in flight and
frees each when that micro-batch's backward runs, so blocks are freed in a
different order than they were allocated; activations passed between
stages are copied as a received buffer would be. --recompute keeps only
each stage's input and recomputes its forward in the backward pass. The
sequence length changes every step (256..1024). bf16 autocast, AdamW. About
15-20 s on an H200:

    python scripts/capture_trace.py -o pipeline_1f1b.trace.csv.gz -- bench/workloads/pipeline_1f1b.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def one_f_one_b(stage, stages, micro_batches):
    """Megatron's 1F1B order for `stage`: a list of ("F" | "B", micro-batch)."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while forward < micro_batches:
        order.append(("F", forward))
        forward += 1
        order.append(("B", backward))
        backward += 1
    order += [("B", m) for m in range(backward, micro_batches)]
    return order


class stage_module(nn.Module):
    def __init__(self, layers, width, heads, vocab, first, last):
        super().__init__()
        self.embed = nn.Embedding(vocab, width) if first else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)) if last else None

    def forward(self, x, mask):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x) if self.head is not None else x


def main():
    p = _workload.parser(__doc__, steps=12)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--recompute", action="store_true", help="stash only stage inputs; recompute in backward")
    args = p.parse_args()
    width, heads, vocab = 1024, 16, 32000
    if args.tiny:
        args.micro_batch, args.min_len, args.max_len, args.layers = 1, 8, 16, 4
        width, heads, vocab = 32, 2, 128
    if args.layers % args.stages:
        p.error("--layers must be a multiple of --stages")
    w = _workload.run("pipeline_1f1b" + ("_recompute" if args.recompute else ""), args)

    stages = [
        stage_module(args.layers // args.stages, width, heads, vocab, s == 0, s == args.stages - 1).to(w.device)
        for s in range(args.stages)
    ]
    params = [q for s in stages for q in s.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    orders = [one_f_one_b(s, args.stages, args.micro_batches) for s in range(args.stages)]
    last = args.stages - 1

    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        tokens = torch.randint(0, vocab, (args.micro_batches, args.micro_batch, length + 1), device=w.device)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=w.device)
        # What each stage has received and not yet used: activations from the
        # previous stage (forward) and gradients from the next (backward).
        received = [dict() for _ in range(args.stages)]
        grads = [dict() for _ in range(args.stages)]
        stash = [dict() for _ in range(args.stages)]  # micro-batch -> (input, output or None)
        position = [0] * args.stages
        while any(position[s] < len(orders[s]) for s in range(args.stages)):
            progressed = False
            for s in range(args.stages):
                if position[s] == len(orders[s]):
                    continue
                kind, m = orders[s][position[s]]
                if kind == "F":
                    if s > 0 and m not in received[s]:
                        continue
                    x = tokens[m, :, :-1] if s == 0 else received[s].pop(m)
                    if args.recompute:
                        with torch.no_grad(), w.autocast():
                            out = stages[s](x, mask)
                        stash[s][m] = (x, None)
                    else:
                        with w.autocast():
                            out = stages[s](x, mask)
                        stash[s][m] = (x, out)
                    if s < last:
                        # The next stage's receive buffer: a copy, detached from this graph.
                        received[s + 1][m] = out.detach().clone().requires_grad_()
                    if args.recompute:
                        del out
                else:
                    if s < last and m not in grads[s]:
                        continue
                    x, out = stash[s].pop(m)
                    if out is None:
                        with w.autocast():
                            out = stages[s](x, mask)
                    if s == last:
                        with w.autocast():
                            loss = F.cross_entropy(out.reshape(-1, vocab).float(), tokens[m, :, 1:].reshape(-1))
                        (loss / args.micro_batches).backward()
                    else:
                        out.backward(grads[s].pop(m))
                    if s > 0:
                        grads[s - 1][m] = x.grad.clone()
                    del x, out
                position[s] += 1
                progressed = True
            if not progressed:
                raise RuntimeError("1F1B schedule deadlocked")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del tokens, mask
    w.finish(
        f"{args.steps} steps of {args.micro_batches} micro-batches over {args.stages} stages, "
        f"recompute {'on' if args.recompute else 'off'}, last loss {loss.item():.3f}"
    )


if __name__ == "__main__":
    main()
