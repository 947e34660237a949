"""Workload for trace capture: LoRA fine-tuning with peft, the way most
people adapt a large model on one GPU: the Llama of the HF workloads
(about 160M parameters from a config with random weights) frozen in bf16,
rank-16 adapters on every attention and MLP projection (peft's
get_peft_model), HF gradient checkpointing, AdamW over the adapters
alone; every step draws a batch of 1..8 sequences of 128..2048 tokens
(a token budget of about 8192 per batch, as length-grouped sampling
gives). About 15-30 s on an H200:

    python scripts/capture_trace.py -o lora_finetune.trace.csv.gz -- bench/workloads/lora_finetune.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 64


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    if args.tiny:
        args.min_len, args.max_len, args.token_budget, args.rank = 8, 32, 64, 4
    w = _workload.run("lora_finetune", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS if args.tiny else 2048)
    config.use_cache = False
    base = LlamaForCausalLM(config).to(device=w.device, dtype=w.dtype())
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(base, lora).train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=2e-4)

    tokens = 0
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        batch = max(1, min(8, args.token_budget // length))
        ids = torch.randint(0, config.vocab_size, (batch, length), device=w.device)
        with w.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch * length
        del ids
    w.finish(f"{args.steps} steps, {tokens} tokens, {sum(p.numel() for p in trained)} trained parameters, "
             f"last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
