"""Workload for trace capture: encoder-decoder (BART-style) training on
pairs of random lengths, as translation and summarisation fine-tuning
runs do: a ~140M-parameter BartConfig with random weights, bf16 autocast,
AdamW; every step draws a batch of 4..32 pairs, a source of 32..1024 and a
target of 16..256 tokens, so the encoder's, the decoder's and the
cross-attention's activations change size independently. About 15-30 s on
an H200:

    python scripts/capture_trace.py -o seq2seq_train.trace.csv.gz -- bench/workloads/seq2seq_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import BartConfig, BartForConditionalGeneration  # noqa: E402


def bart_config(tiny):
    if tiny:
        return BartConfig(
            vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        )
    return BartConfig(
        vocab_size=32000, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_position_embeddings=1024,
    )


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--min-batch", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--min-source", type=int, default=32)
    p.add_argument("--max-source", type=int, default=1024)
    p.add_argument("--min-target", type=int, default=16)
    p.add_argument("--max-target", type=int, default=256)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch = 1, 3
        args.min_source, args.max_source, args.min_target, args.max_target = 4, 32, 2, 16
    w = _workload.run("seq2seq_train", args)

    config = bart_config(args.tiny)
    model = BartForConditionalGeneration(config).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        source = w.randint(args.min_source, args.max_source)
        target = w.randint(args.min_target, args.max_target)
        ids = torch.randint(4, config.vocab_size, (batch, source), device=w.device)
        labels = torch.randint(4, config.vocab_size, (batch, target), device=w.device)
        with w.autocast():
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch * (source + target)
        del ids, labels
    w.finish(f"{args.steps} steps, {tokens} tokens, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
