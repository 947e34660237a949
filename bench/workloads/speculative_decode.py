"""Workload for trace capture: HuggingFace assisted generation (speculative
decoding). A Llama target built from a config with random bf16 weights
verifies the tokens a small Llama draft proposes (5 a round); the tokens
it rejects are cropped from both models' DynamicCaches, so the caches grow
and shrink within every request. Requests of batch 1 (what assisted
generation takes), prompts of random length 16..1024 and 16..48 new tokens
each. About 45-70 s on an H200:

    python scripts/capture_trace.py -o speculative_decode.trace.csv.gz -- \\
        bench/workloads/speculative_decode.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 256  # positions of the tiny models of CPU smoke runs


def draft_config(target):
    """A draft with the target's vocabulary, a quarter of its width and two layers."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=max(target.hidden_size // 4, 32),
        intermediate_size=max(target.intermediate_size // 4, 64),
        num_hidden_layers=2,
        num_attention_heads=max(target.num_attention_heads // 4, 2),
        num_key_value_heads=max(target.num_key_value_heads // 4, 1),
        max_position_embeddings=target.max_position_embeddings,
        attn_implementation="sdpa",
    )


def main():
    p = _workload.parser(__doc__, steps=8)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=48)
    args = p.parse_args()
    if args.tiny:
        args.min_prompt, args.max_prompt, args.min_new, args.max_new = 4, 16, 2, 6
    w = _workload.run("speculative_decode", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    target = LlamaForCausalLM(config).to(device=w.device, dtype=w.dtype()).eval()
    draft = LlamaForCausalLM(draft_config(config)).to(device=w.device, dtype=w.dtype()).eval()
    # A fixed number of proposals a round: the default schedule shrinks it
    # while proposals are rejected.
    draft.generation_config.num_assistant_tokens = 5
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    generated = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            length = w.randint(args.min_prompt, args.max_prompt)
            new_tokens = w.randint(args.min_new, args.max_new)
            ids = torch.randint(1, config.vocab_size, (1, length), device=w.device)
            out = target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=draft,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # random weights must not stop early at an EOS
                do_sample=False,
                pad_token_id=0,
            )
            generated += out.shape[1] - length
            del out, ids
    w.finish(f"{args.steps} requests, {generated} tokens generated with a draft model")


if __name__ == "__main__":
    main()
