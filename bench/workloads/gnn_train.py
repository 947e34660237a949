"""Workload for trace capture: graph neural network training on a new
graph every step, as mini-batches of sampled subgraphs or whole small
graphs give. Each step draws a graph of 20k..400k nodes with 4..16 random
edges per node; a three-layer GraphSAGE-style network (mean of the
neighbours by index_add_, 128 -> 256 -> 256 -> 16 features, fp32, AdamW)
classifies every node. Node and edge tensors change size every step; the
gathered messages (one row per edge) reach several GiB. About 10-15 s on
an H200:

    python scripts/capture_trace.py -o gnn_train.trace.csv.gz -- \\
        bench/workloads/gnn_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class sage_layer(nn.Module):
    """h' = W_self h + W_neigh mean(h of the neighbours)."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.own = nn.Linear(inputs, outputs)
        self.neighbours = nn.Linear(inputs, outputs, bias=False)

    def forward(self, h, source, target, in_degree):
        summed = torch.zeros_like(h).index_add_(0, target, h.index_select(0, source))
        return self.own(h) + self.neighbours(summed / in_degree)


class sage(nn.Module):
    def __init__(self, features, hidden, classes):
        super().__init__()
        self.layers = nn.ModuleList(
            [sage_layer(features, hidden), sage_layer(hidden, hidden), sage_layer(hidden, classes)]
        )

    def forward(self, h, source, target):
        in_degree = torch.bincount(target, minlength=h.shape[0]).clamp(min=1).unsqueeze(1).to(h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, source, target, in_degree)
            if i + 1 < len(self.layers):
                h = F.relu(h)
        return h


def main():
    p = _workload.parser(__doc__, steps=40)
    p.add_argument("--min-nodes", type=int, default=20_000)
    p.add_argument("--max-nodes", type=int, default=400_000)
    p.add_argument("--min-degree", type=int, default=4)
    p.add_argument("--max-degree", type=int, default=16)
    args = p.parse_args()
    features, hidden, classes = (8, 16, 4) if args.tiny else (128, 256, 16)
    if args.tiny:
        args.min_nodes, args.max_nodes = 50, 200
    w = _workload.run("gnn_train", args)

    model = sage(features, hidden, classes).to(w.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    largest = 0
    for _ in range(args.steps):
        nodes = w.randint(args.min_nodes, args.max_nodes)
        edges = nodes * w.randint(args.min_degree, args.max_degree)
        largest = max(largest, nodes)
        x = torch.randn(nodes, features, device=w.device)
        source = torch.randint(0, nodes, (edges,), device=w.device)
        target = torch.randint(0, nodes, (edges,), device=w.device)
        labels = torch.randint(0, classes, (nodes,), device=w.device)
        loss = F.cross_entropy(model(x, source, target), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x, source, target, labels
    w.finish(f"{args.steps} graphs of up to {largest} nodes, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
