"""Workload for trace capture: HuggingFace `generate()` (greedy) on a
Llama model built from a config with random bf16 weights, for a stream of
requests with random batch size 1..16, left-padded prompts of random
lengths up to 16..512 tokens, and 16..64 new tokens each. --cache dynamic
(default) grows a DynamicCache token by token; --cache static preallocates a
StaticCache per request (torch.compile stays off: disable_compile). About
15-25 s on an H200:

    python scripts/capture_trace.py -o hf_generate_dynamic.trace.csv.gz -- \\
        bench/workloads/hf_generate.py --cache dynamic
    python scripts/capture_trace.py -o hf_generate_static.trace.csv.gz -- \\
        bench/workloads/hf_generate.py --cache static
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 256  # positions of the tiny model of CPU smoke runs


def left_padded_prompts(w, batch, longest, min_len, vocab, pad):
    """Token ids (batch, longest) and their attention mask: each prompt has
    its own length in min_len..longest and is padded on the left."""
    ids = torch.full((batch, longest), pad, dtype=torch.long)
    mask = torch.zeros((batch, longest), dtype=torch.long)
    for row in range(batch):
        length = longest if row == 0 else w.randint(min_len, longest)
        ids[row, longest - length :] = torch.randint(1, vocab, (length,))
        mask[row, longest - length :] = 1
    return ids.to(w.device), mask.to(w.device)


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=64)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch, args.min_prompt, args.max_prompt, args.min_new, args.max_new = 1, 3, 4, 16, 2, 6
    w = _workload.run(f"hf_generate_{args.cache}", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    model = LlamaForCausalLM(config).to(device=w.device, dtype=w.dtype()).eval()
    pad = 0
    generated = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(args.min_batch, args.max_batch)
            longest = w.randint(args.min_prompt, args.max_prompt)
            new_tokens = w.randint(args.min_new, args.max_new)
            ids, mask = left_padded_prompts(w, batch, longest, args.min_prompt, config.vocab_size, pad)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # random weights must not stop early at an EOS
                do_sample=False,
                pad_token_id=pad,
                cache_implementation=args.cache,
                disable_compile=True,
            )
            generated += out.shape[0] * (out.shape[1] - longest)
            del out, ids, mask
    w.finish(f"{args.steps} requests, {generated} tokens generated, {args.cache} cache")


if __name__ == "__main__":
    main()
