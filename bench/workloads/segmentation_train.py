"""Workload for trace capture: semantic segmentation training with
torchvision's DeepLabV3-ResNet50 (random weights, output stride 8, its
auxiliary head on, bf16 autocast, SGD with momentum), each step at a new
image size (height and width drawn apart from 256..640 in steps of 32)
and a new batch in 2..8, as random-crop training on images of mixed
shapes does. About 10-25 s on an H200:

    python scripts/capture_trace.py -o segmentation_train.trace.csv.gz -- \\
        bench/workloads/segmentation_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

CLASSES = 21


def main():
    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--min-batch", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--min-side", type=int, default=256)
    p.add_argument("--max-side", type=int, default=640)
    args = p.parse_args()
    if args.tiny:
        args.min_batch, args.max_batch, args.min_side, args.max_side = 2, 2, 64, 96
    w = _workload.run("segmentation_train", args)

    model = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=CLASSES, aux_loss=True
    ).to(w.device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    sides = range(args.min_side, args.max_side + 1, 32)
    shapes = []
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        height, width = w.choice(sides), w.choice(sides)
        shapes.append((batch, height, width))
        images = torch.randn(batch, 3, height, width, device=w.device)
        masks = torch.randint(0, CLASSES, (batch, height, width), device=w.device)
        with w.autocast():
            out = model(images)
            loss = F.cross_entropy(out["out"], masks) + 0.4 * F.cross_entropy(out["aux"], masks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del images, masks, out
    pixels = [b * h * w_ for b, h, w_ in shapes]
    w.finish(f"{args.steps} steps, {min(pixels)}..{max(pixels)} pixels a batch, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
