"""Workload for trace capture: contrastive image-text training (CLIP-style)
with a batch that changes every step, as a run whose data loader drops
filtered pairs does: a CLIPConfig with random weights (a ViT-B/32-sized
vision tower at 224 px and a 12-layer text tower, about 150M parameters),
bf16 autocast, AdamW; every step draws 64..384 pairs with captions of
16..77 tokens, and the loss is the symmetric cross-entropy over the
batch-by-batch similarity matrix. About 20-40 s on an H200:

    python scripts/capture_trace.py -o clip_train.trace.csv.gz -- bench/workloads/clip_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import CLIPConfig, CLIPModel  # noqa: E402


def clip_config(tiny):
    if tiny:
        return CLIPConfig(
            text_config={"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "max_position_embeddings": 77},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
            projection_dim=16,
        )
    return CLIPConfig(
        text_config={"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                     "num_attention_heads": 8, "max_position_embeddings": 77},
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "image_size": 224, "patch_size": 32},
        projection_dim=512,
    )


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--min-batch", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=384)
    p.add_argument("--min-caption", type=int, default=16)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch, args.min_caption = 2, 6, 4
    w = _workload.run("clip_train", args)

    config = clip_config(args.tiny)
    model = CLIPModel(config).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    side = config.vision_config.image_size
    longest = config.text_config.max_position_embeddings
    pairs = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        caption = w.randint(args.min_caption, longest)
        images = torch.randn(batch, 3, side, side, device=w.device)
        text = torch.randint(0, config.text_config.vocab_size, (batch, caption), device=w.device)
        with w.autocast():
            out = model(input_ids=text, pixel_values=images)
            target = torch.arange(batch, device=w.device)
            loss = (F.cross_entropy(out.logits_per_image.float(), target)
                    + F.cross_entropy(out.logits_per_text.float(), target)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pairs += batch
        del images, text, out, target
    w.finish(f"{args.steps} steps, {pairs} pairs, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
