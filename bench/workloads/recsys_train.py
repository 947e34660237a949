"""Workload for trace capture: a DLRM-style recommender (eight embedding
tables of 50k..1M rows x 128 with sparse gradients, an interaction MLP)
trained with SparseAdam for the tables and Adam for the MLPs, on batches
of 512..8192 samples with 1..40 ids per feature bag, so the sparse
gradients (coalesced, indexed) have a new size every step. About 10 s
on an H200:

    python scripts/capture_trace.py -o recsys_sparse_train.trace.csv.gz -- bench/workloads/recsys_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


class recommender(nn.Module):
    def __init__(self, rows, dim, dense):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in rows)
        self.bottom = nn.Sequential(nn.Linear(dense, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        features = len(rows) + 1
        self.top = nn.Sequential(nn.Linear(features * features + dim, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, dense, bags):
        x = self.bottom(dense)
        vectors = [x] + [table(ids, offsets) for table, (ids, offsets) in zip(self.tables, bags)]
        stacked = torch.stack(vectors, dim=1)
        interactions = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
        return self.top(torch.cat([x, interactions], dim=1)).squeeze(1)


def main():
    p = _workload.parser(__doc__, steps=60)
    p.add_argument("--min-batch", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=8192)
    p.add_argument("--max-bag", type=int, default=40)
    args = p.parse_args()
    rows = [1_000_000, 500_000, 200_000, 200_000, 100_000, 100_000, 50_000, 50_000]
    dim, dense = 128, 13
    if args.tiny:
        rows, dim, args.min_batch, args.max_batch, args.max_bag = [100, 50], 8, 4, 16, 4
    w = _workload.run("recsys_train", args)
    model = recommender(rows, dim, dense).to(w.device)
    sparse = torch.optim.SparseAdam(list(model.tables.parameters()), lr=1e-3)
    dense_opt = torch.optim.Adam(list(model.bottom.parameters()) + list(model.top.parameters()), lr=1e-3)
    samples = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        bags = []
        for r in rows:
            counts = torch.randint(1, w.randint(1, args.max_bag) + 1, (batch,))
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
            ids = torch.randint(0, r, (int(counts.sum()),))
            bags.append((ids.to(w.device), offsets.to(w.device)))
        dense_in = torch.randn(batch, dense, device=w.device)
        labels = torch.randint(0, 2, (batch,), device=w.device).float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense_in, bags), labels)
        loss.backward()
        sparse.step()
        dense_opt.step()
        sparse.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        samples += batch
        del bags, dense_in, labels, loss
    w.finish(f"{args.steps} steps, {samples} samples")


if __name__ == "__main__":
    main()
