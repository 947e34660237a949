"""Workload for trace capture: a training loop that evaluates as it goes,
as most fine-tuning scripts do. A HuggingFace Llama (the ~160M config with
random weights, bf16 autocast, AdamW) trains on batches of 8 sequences of a
random length in 64..1024; every fifth step an evaluation pass under
inference_mode runs 4 batches of 16 sequences of other lengths (loss and
token accuracy from the logits) while the optimizer state stays
allocated. About 15-35 s on an H200:

    python scripts/capture_trace.py -o train_eval_loop.trace.csv.gz -- \\
        bench/workloads/train_eval_loop.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

TINY_POSITIONS = 128  # positions of the tiny model of CPU smoke runs


def evaluate(w, model, vocab, args):
    """Mean loss and token accuracy of `args.eval_batches` random batches."""
    model.eval()
    losses, hits, tokens_seen = [], 0, 0
    with torch.inference_mode(), w.autocast():
        for _ in range(args.eval_batches):
            length = w.randint(args.min_len, args.max_len)
            tokens = torch.randint(0, vocab, (args.eval_batch, length), device=w.device)
            out = model(input_ids=tokens, labels=tokens)
            predicted = out.logits.argmax(dim=-1)
            hits += int((predicted[:, :-1] == tokens[:, 1:]).sum())
            tokens_seen += tokens[:, 1:].numel()
            losses.append(out.loss.float())
            del out, predicted
    model.train()
    return float(torch.stack(losses).mean()), hits / tokens_seen


def main():
    p = _workload.parser(__doc__, steps=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.eval_batch, args.eval_batches, args.eval_every, args.min_len, args.max_len = 2, 3, 2, 1, 8, 32
    w = _workload.run("train_eval_loop", args)

    config = _workload.llama_config(args.tiny, TINY_POSITIONS)
    config.use_cache = False
    model = LlamaForCausalLM(config).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    evaluations = 0
    eval_loss = accuracy = float("nan")
    for step in range(1, args.steps + 1):
        length = w.randint(args.min_len, args.max_len)
        tokens = torch.randint(0, config.vocab_size, (args.batch, length), device=w.device)
        loss = w.causal_lm_step(model, optimizer, tokens)
        if step % args.eval_every == 0:
            eval_loss, accuracy = evaluate(w, model, config.vocab_size, args)
            evaluations += 1
    w.finish(
        f"{args.steps} steps, {evaluations} evaluations, last loss {loss.item():.3f}, "
        f"last eval loss {eval_loss:.3f} accuracy {accuracy:.4f}"
    )


if __name__ == "__main__":
    main()
