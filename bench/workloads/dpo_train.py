"""Workload for trace capture: preference tuning with DPO on a Llama model
built from a config with random weights. Each step scores a batch of 4
(chosen, rejected) pairs, each side of its own random length in 64..512,
under the policy (bf16 autocast, with gradients) and under a frozen bf16
copy as the reference (no gradients), and takes an AdamW step on the DPO
loss: two models, four forward passes and full-vocabulary log-softmaxes a
step, the pattern of RLHF-style fine-tuning. About 15-25 s on an H200:

    python scripts/capture_trace.py -o dpo_train.trace.csv.gz -- \\
        bench/workloads/dpo_train.py
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 64  # positions of the tiny model of CPU smoke runs


def sequence_logprobs(model, tokens):
    """Sum over each row of the log-probability of every token after the first."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    picked = torch.gather(F.log_softmax(logits, dim=-1), 2, tokens[:, 1:, None]).squeeze(2)
    return picked.sum(dim=1)


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--batch", type=int, default=4, help="preference pairs per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--beta", type=float, default=0.1)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 4, 16
    w = _workload.run("dpo_train", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    config.use_cache = False
    policy = LlamaForCausalLM(config).to(w.device).train()
    reference = copy.deepcopy(policy).to(dtype=w.dtype()).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    for _ in range(args.steps):
        chosen = torch.randint(1, config.vocab_size, (args.batch, w.randint(args.min_len, args.max_len)), device=w.device)
        rejected = torch.randint(1, config.vocab_size, (args.batch, w.randint(args.min_len, args.max_len)), device=w.device)
        with torch.no_grad():
            ref_margin = sequence_logprobs(reference, chosen) - sequence_logprobs(reference, rejected)
        with w.autocast():
            margin = sequence_logprobs(policy, chosen) - sequence_logprobs(policy, rejected)
        loss = -F.logsigmoid(args.beta * (margin - ref_margin)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    w.finish(f"{args.steps} steps, {args.batch} pairs each, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
