"""Workload for trace capture: training a small mixture-of-experts
transformer (4 layers, 1024 wide, 8 experts of 2048 hidden units a layer,
top-2 routing without a capacity limit, as dropless MoE does) with bf16
autocast and AdamW. Tokens are sorted by expert and each expert runs on
however many tokens the router sent it, so the expert activations change
size every layer and every step; sequence lengths vary too (128..1024).
About 10-15 s on an H200:

    python scripts/capture_trace.py -o moe_train.trace.csv.gz -- bench/workloads/moe_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class moe_ffn(nn.Module):
    """Top-k routed experts; tokens are gathered per expert, run through it
    and scattered back weighted by their router probabilities."""

    def __init__(self, width, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(experts)
        )

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one sync, as dropless MoE has
        token = order // self.top_k
        routed = x.index_select(0, token)
        outputs = [expert(part) for expert, part in zip(self.experts, routed.split(counts)) if part.shape[0] > 0]
        combined = torch.cat(outputs) * weights.flatten()[order].unsqueeze(-1).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token, combined.to(x.dtype))
        return out.reshape(shape), counts


class block(nn.Module):
    def __init__(self, width, heads, hidden, experts, top_k):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.moe = moe_ffn(width, hidden, experts, top_k)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        routed, counts = self.moe(self.ln_2(x))
        return x + routed, counts


class moe_model(nn.Module):
    def __init__(self, vocab, width, layers, heads, hidden, experts, top_k):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(block(width, heads, hidden, experts, top_k) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        loads = []
        for layer in self.blocks:
            x, counts = layer(x)
            loads.append(counts)
        return self.head(self.ln_f(x)), loads


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 8, 32
        dims = dict(vocab=256, width=32, layers=2, heads=2, hidden=64)
    else:
        dims = dict(vocab=32000, width=1024, layers=4, heads=16, hidden=2048)
    w = _workload.run("moe_train", args)

    model = moe_model(experts=args.experts, top_k=args.top_k, **dims).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    smallest, largest = None, 0
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        tokens = torch.randint(0, dims["vocab"], (args.batch, length + 1), device=w.device)
        with w.autocast():
            logits, loads = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_expert = [c for layer in loads for c in layer]
        smallest = min(per_expert) if smallest is None else min(smallest, min(per_expert))
        largest = max(largest, max(per_expert))
        del logits, tokens
    w.finish(f"{args.steps} steps, tokens per expert {smallest}..{largest}, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
