"""Workload for trace capture: HuggingFace Llama causal-LM training (a
~160M-parameter LlamaConfig with random weights, SDPA attention, bf16
autocast, AdamW, loss computed by the model from labels) where every step
draws a new sequence length in 64..1024, as a fine-tuning run on unpacked
text does. --checkpointing turns on HF gradient checkpointing (activations
recomputed layer by layer in the backward pass). About 10-15 s on an H200:

    python scripts/capture_trace.py -o hf_llama_train_varlen.trace.csv.gz -- \\
        bench/workloads/hf_llama_train.py
    python scripts/capture_trace.py -o hf_llama_train_varlen_ckpt.trace.csv.gz -- \\
        bench/workloads/hf_llama_train.py --checkpointing
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 128  # positions of the tiny model of CPU smoke runs


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 8, 32
    w = _workload.run("hf_llama_train" + ("_ckpt" if args.checkpointing else ""), args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    config.use_cache = False
    model = LlamaForCausalLM(config).to(w.device).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    lengths = []
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        lengths.append(length)
        tokens = torch.randint(0, config.vocab_size, (args.batch, length), device=w.device)
        loss = w.causal_lm_step(model, optimizer, tokens)
    w.finish(
        f"{args.steps} steps, batch {args.batch}, lengths {min(lengths)}..{max(lengths)}, "
        f"checkpointing {'on' if args.checkpointing else 'off'}, last loss {loss.item():.3f}"
    )


if __name__ == "__main__":
    main()
