"""Workload for trace capture: a BERT-base encoder (HuggingFace BertModel
from a BertConfig, random bf16 weights, SDPA attention) serving requests
of random batch size 1..64 and random padded length 16..512, as an
embedding or classification service does; each request's pooled output is
kept until a few requests later, as responses wait to be sent. About 5-10 s
on an H200:

    python scripts/capture_trace.py -o bert_serve.trace.csv.gz -- bench/workloads/bert_serve.py
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import BertConfig, BertModel  # noqa: E402


def bert_config(tiny):
    if tiny:
        return BertConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=128, attn_implementation="sdpa",
        )
    return BertConfig(attn_implementation="sdpa")  # bert-base: 12 layers, 768 wide, 30522 tokens


def main():
    p = _workload.parser(__doc__, steps=100)
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--in-flight", type=int, default=4, help="responses kept before the oldest is dropped")
    args = p.parse_args()
    if args.tiny:
        args.max_batch, args.min_len, args.max_len = 4, 4, 32
    w = _workload.run("bert_serve", args)

    config = bert_config(args.tiny)
    model = BertModel(config, add_pooling_layer=True).to(device=w.device, dtype=w.dtype()).eval()
    responses = collections.deque()
    tokens = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(args.min_batch, args.max_batch)
            length = w.randint(args.min_len, args.max_len)
            ids = torch.randint(1, config.vocab_size, (batch, length), device=w.device)
            # Shorter sequences of the batch are padded at the end.
            lengths = torch.randint(max(1, length // 4), length + 1, (batch,), device=w.device)
            mask = (torch.arange(length, device=w.device).unsqueeze(0) < lengths.unsqueeze(1)).long()
            out = model(input_ids=ids, attention_mask=mask)
            responses.append(out.pooler_output)
            if len(responses) > args.in_flight:
                responses.popleft()
            tokens += batch * length
            del out, ids, mask, lengths
    responses.clear()
    w.finish(f"{args.steps} requests, {tokens} tokens")


if __name__ == "__main__":
    main()
