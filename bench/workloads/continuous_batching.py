"""Workload for trace capture: an LLM server with continuous batching in
plain torch. Requests arrive while others are being answered (prompt
16..1024 tokens, answer 16..384 tokens); each scheduler iteration admits
new requests up to a limit in flight, prefills their prompts, and decodes
one token for every request in flight, each request growing its own
per-layer KV caches by torch.cat. Requests finish at different times, so
KV caches of every length are allocated and freed interleaved, the
pattern paged KV caches were invented for. A GPT-2-style decoder 2048
wide with 16 layers (about 0.9B parameters, bf16, random weights).
About 2.5 minutes under scripts/capture_trace.py on an H200 (beside a build):

    python scripts/capture_trace.py -o continuous_batching.trace.csv.gz -- \\
        bench/workloads/continuous_batching.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
from gpt2_model import gpt2, gpt2_config  # noqa: E402


def model_config(tiny):
    if tiny:
        return gpt2_config(vocab_size=256, n_ctx=128, n_embd=64, n_layer=2, n_head=4)
    return gpt2_config(vocab_size=50257, n_ctx=2048, n_embd=2048, n_layer=16, n_head=16)


class request:
    """One request in flight: its caches, its position, its answer's length
    and how many of its tokens are still to come."""

    def __init__(self, model, prompt, answer_tokens):
        self.caches = [[None, None] for _ in model.blocks]
        logits = model(prompt, self.caches, start=0)
        self.position = prompt.shape[1]
        self.token = logits[:, -1:].argmax(dim=-1)
        self.answer_tokens = answer_tokens
        self.left = answer_tokens - 1

    def step(self, model):
        logits = model(self.token, self.caches, start=self.position)
        self.position += 1
        self.token = logits[:, -1:].argmax(dim=-1)
        self.left -= 1


def main():
    p = _workload.parser(__doc__, steps=400)
    p.add_argument("--max-in-flight", type=int, default=12)
    p.add_argument("--arrival", type=float, default=0.25, help="chance a new request arrives per iteration and free slot")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-answer", type=int, default=16)
    p.add_argument("--max-answer", type=int, default=384)
    args = p.parse_args()
    if args.tiny:
        args.max_in_flight, args.arrival = 3, 0.9
        args.min_prompt, args.max_prompt, args.min_answer, args.max_answer = 4, 32, 2, 16
    w = _workload.run("continuous_batching", args)

    config = model_config(args.tiny)
    if args.max_prompt + args.max_answer > config.n_ctx:
        p.error(f"--max-prompt + --max-answer must be at most {config.n_ctx}")
    model = gpt2(config).to(device=w.device, dtype=w.dtype()).eval()
    in_flight = []
    served = 0
    tokens = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            for _ in range(args.max_in_flight - len(in_flight)):
                if w.rng.random() >= args.arrival:
                    continue
                length = w.randint(args.min_prompt, args.max_prompt)
                prompt = torch.randint(0, config.vocab_size, (1, length), device=w.device)
                in_flight.append(request(model, prompt, w.randint(args.min_answer, args.max_answer)))
            for r in in_flight:
                if r.left > 0:
                    r.step(model)
            for r in [r for r in in_flight if r.left <= 0]:
                in_flight.remove(r)
                served += 1
                tokens += r.answer_tokens
    w.finish(f"{args.steps} iterations, {served} requests answered, {tokens} tokens")


if __name__ == "__main__":
    main()
