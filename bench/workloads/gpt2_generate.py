"""Workload for trace capture: GPT-2-small generation (bf16 weights, greedy)
for a stream of requests with random batch size 1..16 and prompt length
16..512, each growing its per-layer KV caches by torch.cat one token at a
time, the pattern of a simple serving loop. Runs in well under a minute:

    python scripts/capture_trace.py -o gpt2_generate.trace.csv.gz -- \\
        bench/workloads/gpt2_generate.py
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_model import decode, gpt2  # noqa: E402


def greedy(last_logits):
    return last_logits.argmax(dim=-1, keepdim=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--min-batch", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model = gpt2().to(device="cuda", dtype=torch.bfloat16).eval()
    if args.max_prompt + args.new_tokens > model.config.n_ctx:
        parser.error(f"--max-prompt + --new-tokens must be at most {model.config.n_ctx}")
    vocab = model.config.vocab_size
    start = time.perf_counter()
    generated = 0
    for _ in range(args.requests):
        batch = rng.randint(args.min_batch, args.max_batch)
        length = rng.randint(args.min_prompt, args.max_prompt)
        prompt = torch.randint(0, vocab, (batch, length), device="cuda")
        generated += decode(model, prompt, args.new_tokens, greedy).numel()
    torch.cuda.synchronize()
    print(
        f"gpt2_generate: {args.requests} requests, {generated} tokens generated, "
        f"{time.perf_counter() - start:.1f} s, peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
        f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
