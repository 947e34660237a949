"""Workload for trace capture: HuggingFace Mamba (a state-space language
model, MambaConfig with random weights) trained with a new sequence length
in 64..384 every step, batch 8, bf16 autocast, AdamW. Without the
mamba-ssm and causal-conv1d kernels the model runs its pure-PyTorch path,
whose selective scan steps through the sequence one position at a time:
thousands of small state tensors kept for the backward pass per step,
unlike any attention model. About 20-40 s on an H200:

    python scripts/capture_trace.py -o mamba_train_varlen.trace.csv.gz -- \\
        bench/workloads/mamba_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402


def main():
    p = _workload.parser(__doc__, steps=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=384)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 4, 12
        config = MambaConfig(vocab_size=256, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2)
    else:
        config = MambaConfig(vocab_size=32000, hidden_size=768, state_size=16, num_hidden_layers=8, expand=2)
    config.use_cache = False
    w = _workload.run("mamba_train", args)

    model = MambaForCausalLM(config).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    lengths = []
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        lengths.append(length)
        tokens = torch.randint(0, config.vocab_size, (args.batch, length), device=w.device)
        loss = w.causal_lm_step(model, optimizer, tokens)
    w.finish(f"{args.steps} steps, batch {args.batch}, lengths {min(lengths)}..{max(lengths)}, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
