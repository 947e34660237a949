"""Workload for trace capture: sampled generation with several answers per
prompt on a model with sliding-window attention. A Mistral-style decoder
(about 160M parameters from a config with random bf16 weights, a 256-token
attention window) answers requests of random batch 1..8, left-padded
prompts of random length up to 16..768 tokens, with 1..4 sampled answers
per prompt (top-p 0.9, temperature 0.8) of 32..160 new tokens each, so the
batch the caches hold is prompts x answers, and the window's layers keep
only their last 256 positions. About 40-65 s on an H200:

    python scripts/capture_trace.py -o sampled_generate.trace.csv.gz -- \\
        bench/workloads/sampled_generate.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from hf_generate import left_padded_prompts  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402


def mistral_config(tiny):
    if tiny:
        return MistralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, sliding_window=16, attn_implementation="sdpa",
        )
    return MistralConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=2048, sliding_window=256, attn_implementation="sdpa",
    )


def main():
    p = _workload.parser(__doc__, steps=16)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--max-answers", type=int, default=4)
    p.add_argument("--min-new", type=int, default=32)
    p.add_argument("--max-new", type=int, default=160)
    args = p.parse_args()
    if args.tiny:
        args.max_batch, args.min_prompt, args.max_prompt = 2, 4, 24
        args.max_answers, args.min_new, args.max_new = 2, 2, 6
    w = _workload.run("sampled_generate", args)

    config = mistral_config(args.tiny)
    model = MistralForCausalLM(config).to(device=w.device, dtype=w.dtype()).eval()
    pad = 0
    generated = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(1, args.max_batch)
            longest = w.randint(args.min_prompt, args.max_prompt)
            answers = w.randint(1, args.max_answers)
            new_tokens = w.randint(args.min_new, args.max_new)
            ids, mask = left_padded_prompts(w, batch, longest, args.min_prompt, config.vocab_size, pad)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # random weights must not stop early at an EOS
                do_sample=True,
                top_p=0.9,
                temperature=0.8,
                num_return_sequences=answers,
                pad_token_id=pad,
            )
            generated += out.shape[0] * (out.shape[1] - longest)
            del out, ids, mask
    w.finish(f"{args.steps} requests, {generated} tokens sampled")


if __name__ == "__main__":
    main()
