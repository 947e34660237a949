"""Workload for trace capture: RL fine-tuning of a language model in the
style of PPO/GRPO on one GPU, where generation and training take turns
with the same memory. Each step samples completions from the policy
(GPT-2 small, growing KV caches by torch.cat; batch 8..32, prompts
32..256 tokens, 32..128 new tokens), scores the whole sequences with a
frozen bf16 reference copy (log-probabilities over the vocabulary), then
trains the policy on them in two minibatches with bf16 autocast and AdamW
(a policy-gradient loss with random advantages and a penalty for drifting
from the reference). About 75 s under scripts/capture_trace.py on an
H200:

    python scripts/capture_trace.py -o rl_rollout_train.trace.csv.gz -- \\
        bench/workloads/rl_rollout_train.py
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
from gpt2_model import decode, gpt2, gpt2_config  # noqa: E402


def sampled(last_logits):
    return torch.multinomial(last_logits.float().softmax(dim=-1), 1)


def token_logprobs(logits, tokens):
    """log p(tokens[:, 1:]) under `logits[:, :-1]`, in float32."""
    return logits[:, :-1].float().log_softmax(dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def main():
    p = _workload.parser(__doc__, steps=12)
    p.add_argument("--min-batch", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-new", type=int, default=32)
    p.add_argument("--max-new", type=int, default=128)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch, args.min_prompt, args.max_prompt, args.min_new, args.max_new = 2, 4, 4, 16, 2, 8
    w = _workload.run("rl_rollout_train", args)

    config = gpt2_config(vocab_size=256, n_ctx=64, n_embd=64, n_layer=2, n_head=4) if args.tiny else gpt2_config()
    policy = gpt2(config).to(w.device)
    reference = copy.deepcopy(policy).to(dtype=w.dtype()).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    tokens = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        prompt_len = w.randint(args.min_prompt, args.max_prompt)
        new = w.randint(args.min_new, args.max_new)
        prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), device=w.device)
        policy.eval()
        with w.autocast():
            completion = decode(policy, prompt, new, sampled)
        sequences = torch.cat([prompt, completion], dim=1)
        del prompt, completion
        with torch.no_grad():
            reference_logprobs = token_logprobs(reference(sequences), sequences)[:, prompt_len - 1 :]
        advantages = torch.randn(batch, 1, device=w.device)
        policy.train()
        for part in range(2):
            rows = slice(part * batch // 2, (part + 1) * batch // 2) if batch > 1 else slice(0, 1)
            with w.autocast():
                logprobs = token_logprobs(policy(sequences[rows]), sequences[rows])[:, prompt_len - 1 :]
            drift = logprobs - reference_logprobs[rows]
            loss = -(advantages[rows] * logprobs).mean() + 0.05 * (drift * drift).mean()
            loss.backward()
            del logprobs, drift, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += sequences.numel()
        del sequences, reference_logprobs, advantages
    w.finish(f"{args.steps} steps, {tokens} tokens")


if __name__ == "__main__":
    main()
