"""Workload for trace capture: torchvision image-model training (random
weights, bf16 autocast). --model resnet50 (default) trains at a new square
image size every step, drawn from 128..288 in steps of 32 (multi-scale
training, progressive resizing), batch 48, SGD with momentum; --model
vit_b_16 trains a ViT-B/16 at 224x224 with a new batch size in 16..64 every
step, AdamW; --model convnext_tiny trains a ConvNeXt-T (depthwise 7x7
convolutions, LayerNorm) at resnet50's image sizes and batch, AdamW. About
10-15 s each on an H200:

    python scripts/capture_trace.py -o resnet50_train_varsize.trace.csv.gz -- \\
        bench/workloads/vision_train.py --model resnet50
    python scripts/capture_trace.py -o vit_b16_train_varbatch.trace.csv.gz -- \\
        bench/workloads/vision_train.py --model vit_b_16
    python scripts/capture_trace.py -o convnext_train_varsize.trace.csv.gz -- \\
        bench/workloads/vision_train.py --model convnext_tiny
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402


# The models trained at a new image size every step.
MULTI_SCALE = ("resnet50", "convnext_tiny")


def build(name, tiny):
    """The model (random weights) and its number of classes."""
    if name in MULTI_SCALE:
        classes = 10 if tiny else 1000
        return getattr(torchvision.models, name)(weights=None, num_classes=classes), classes
    if tiny:
        model = torchvision.models.VisionTransformer(
            image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
        )
        return model, 10
    return torchvision.models.vit_b_16(weights=None), 1000


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--model", choices=[*MULTI_SCALE, "vit_b_16"], default="resnet50")
    p.add_argument("--batch", type=int, default=48, help="resnet50's and convnext_tiny's batch size")
    p.add_argument("--sizes", default="128,160,192,224,256,288", help="resnet50's and convnext_tiny's image sizes")
    p.add_argument("--min-batch", type=int, default=16, help="vit_b_16's smallest batch")
    p.add_argument("--max-batch", type=int, default=64, help="vit_b_16's largest batch")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.sizes, args.min_batch, args.max_batch = 2, "32,64", 1, 3
    w = _workload.run(f"{args.model}_train", args)

    model, classes = build(args.model, args.tiny)
    model.to(w.device).train()
    if args.model == "resnet50":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    sizes = [int(s) for s in args.sizes.split(",")]
    vit_size = 32 if args.tiny else 224

    shapes = []
    for _ in range(args.steps):
        if args.model in MULTI_SCALE:
            batch, size = args.batch, w.choice(sizes)
        else:
            batch, size = w.randint(args.min_batch, args.max_batch), vit_size
        shapes.append((batch, size))
        images = torch.randn(batch, 3, size, size, device=w.device)
        labels = torch.randint(0, classes, (batch,), device=w.device)
        with w.autocast():
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del images, labels
    batches = sorted({b for b, _ in shapes})
    sizes_seen = sorted({s for _, s in shapes})
    w.finish(f"{args.steps} steps, batches {batches}, image sizes {sizes_seen}, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
