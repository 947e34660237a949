"""Workload for trace capture: a two-layer LSTM language model (hidden
1024, vocabulary 32000, fp32 as cuDNN's RNN kernels run it) trained on
batches of 16..64 sequences of random lengths 32..512, packed with
pack_padded_sequence, so every step asks cuDNN for a workspace and a
reserve of a new size. About 10 s on an H200:

    python scripts/capture_trace.py -o lstm_train_varlen.trace.csv.gz -- bench/workloads/lstm_varlen.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402


class lstm_lm(nn.Module):
    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.head(out)


def main():
    p = _workload.parser(__doc__, steps=40)
    p.add_argument("--min-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    vocab = 32000
    if args.tiny:
        args.min_batch, args.max_batch, args.min_len, args.max_len, args.hidden, vocab = 2, 4, 4, 16, 32, 128
    w = _workload.run("lstm_varlen", args)
    model = lstm_lm(vocab, args.hidden, 2).to(w.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        length = w.randint(args.min_len, args.max_len)
        ids = torch.randint(0, vocab, (batch, length), device=w.device)
        lengths = torch.randint(max(1, length // 4), length + 1, (batch,))
        lengths[0] = length
        logits = model(ids, lengths.to(w.device))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(lengths.sum())
        del logits, loss, ids
    w.finish(f"{args.steps} steps, {tokens} tokens")


if __name__ == "__main__":
    main()
