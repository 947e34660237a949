"""Workload for trace capture: an encoder-decoder (HuggingFace T5 from a
T5Config, about t5-base's shape, random bf16 weights) translating a
stream of requests of random batch size 1..16 and source length 16..512
with beam search (1, 2 or 4 beams: every step reorders the decoder's
self-attention cache by beam) and 16..64 new tokens. About 30-40 s on an
H200:

    python scripts/capture_trace.py -o t5_beam_generate.trace.csv.gz -- bench/workloads/t5_generate.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402


def t5_config(tiny):
    if tiny:
        return T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def main():
    p = _workload.parser(__doc__, steps=24)
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--min-source", type=int, default=16)
    p.add_argument("--max-source", type=int, default=512)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--beams", default="1,2,4", help="beam counts drawn per request")
    args = p.parse_args()
    if args.tiny:
        args.max_batch, args.min_source, args.max_source, args.min_new, args.max_new = 3, 4, 16, 2, 6
    beams = [int(b) for b in args.beams.split(",")]
    w = _workload.run("t5_generate", args)
    config = t5_config(args.tiny)
    model = T5ForConditionalGeneration(config).to(device=w.device, dtype=w.dtype()).eval()
    generated = 0
    with torch.inference_mode():
        for _ in range(args.steps):
            batch = w.randint(args.min_batch, args.max_batch)
            length = w.randint(args.min_source, args.max_source)
            new_tokens = w.randint(args.min_new, args.max_new)
            num_beams = w.choice(beams)
            ids = torch.randint(2, config.vocab_size, (batch, length), device=w.device)
            lengths = torch.randint(max(1, length // 2), length + 1, (batch,), device=w.device)
            mask = (torch.arange(length, device=w.device).unsqueeze(0) < lengths.unsqueeze(1)).long()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # random weights must not stop early at an EOS
                num_beams=num_beams,
                do_sample=False,
                disable_compile=True,
            )
            generated += out.numel()
            del out, ids, mask, lengths
    w.finish(f"{args.steps} requests, {generated} tokens generated")


if __name__ == "__main__":
    main()
