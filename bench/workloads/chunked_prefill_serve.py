"""Workload for trace capture: long-prompt serving with chunked prefill on
a Llama model built from a config with random bf16 weights. Each request
has a random batch of 1..4 prompts of one random length in 256..1536
tokens; the prompt goes through the model in chunks of --chunk tokens
(256) into a DynamicCache, keeping only the last position's logits, and
then 16..48 tokens are decoded greedily one at a time, as a server that
bounds its prefill work per forward pass does. About 10-20 s on an H200:

    python scripts/capture_trace.py -o chunked_prefill_serve.trace.csv.gz -- \\
        bench/workloads/chunked_prefill_serve.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 128  # positions of the tiny model of CPU smoke runs


def serve(model, ids, chunk, new_tokens):
    """Prefills `ids` chunk by chunk, then decodes `new_tokens` greedily;
    returns the number of tokens decoded."""
    cache = DynamicCache()
    last = None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1]
    token = last.argmax(-1, keepdim=True)
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return ids.shape[0] * new_tokens


def main():
    p = _workload.parser(__doc__, steps=24)
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens per prefill forward pass")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--min-prompt", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=1536)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=48)
    args = p.parse_args()
    if args.tiny:
        args.chunk, args.max_batch, args.min_prompt, args.max_prompt, args.min_new, args.max_new = 8, 2, 8, 40, 2, 4
    w = _workload.run("chunked_prefill_serve", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    model = LlamaForCausalLM(config).to(device=w.device, dtype=w.dtype()).eval()
    decoded = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(1, args.max_batch)
            length = w.randint(args.min_prompt, args.max_prompt)
            ids = torch.randint(1, config.vocab_size, (batch, length), device=w.device)
            decoded += serve(model, ids, args.chunk, w.randint(args.min_new, args.max_new))
    w.finish(f"{args.steps} requests, chunks of {args.chunk}, {decoded} tokens decoded")


if __name__ == "__main__":
    main()
