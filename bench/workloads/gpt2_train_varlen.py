"""Workload for trace capture: GPT-2-small training (bf16 autocast, AdamW)
where every step draws a new sequence length in 32..1024, the pattern that
fragments a block-caching allocator. Runs in well under a minute on an H200:

    python scripts/capture_trace.py -o gpt2_train_varlen.trace.csv.gz -- \\
        bench/workloads/gpt2_train_varlen.py
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_model import make_training, training_step  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    model, optimizer = make_training(seed=args.seed)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    lengths = []
    for _ in range(args.steps):
        length = rng.randint(args.min_len, args.max_len)
        lengths.append(length)
        tokens = torch.randint(0, vocab, (args.batch, length + 1), device="cuda")
        training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    print(
        f"gpt2_train_varlen: {args.steps} steps, batch {args.batch}, lengths {min(lengths)}..{max(lengths)}, "
        f"{time.perf_counter() - start:.1f} s, peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
        f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
