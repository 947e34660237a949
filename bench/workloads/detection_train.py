"""Workload for trace capture: torchvision's Faster R-CNN (ResNet-50 FPN,
random weights, 11 classes) trained on batches of 2..8 images of random
height and width 320..1024 with 1..30 random boxes each. The model's
transform resizes each image within 512..800 and pads the batch, and the
region proposal network and the ROI heads keep a different number of
boxes every step, so few shapes repeat. About 10-15 s on an H200:

    python scripts/capture_trace.py -o detection_train.trace.csv.gz -- bench/workloads/detection_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402


def random_targets(w, batch, sides, classes):
    images, targets = [], []
    for _ in range(batch):
        h, wd = w.randint(*sides), w.randint(*sides)
        images.append(torch.rand(3, h, wd, device=w.device))
        n = w.randint(1, 30)
        x0 = torch.rand(n) * (wd - 16)
        y0 = torch.rand(n) * (h - 16)
        x1 = x0 + 8 + torch.rand(n) * (wd - x0 - 8)
        y1 = y0 + 8 + torch.rand(n) * (h - y0 - 8)
        targets.append({
            "boxes": torch.stack([x0, y0, x1, y1], dim=1).to(w.device),
            "labels": torch.randint(1, classes, (n,), device=w.device),
        })
    return images, targets


def main():
    import torchvision

    p = _workload.parser(__doc__, steps=30)
    p.add_argument("--min-batch", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--min-side", type=int, default=320)
    p.add_argument("--max-side", type=int, default=1024)
    args = p.parse_args()
    sizes = {"min_size": 512, "max_size": 800}
    if args.tiny:
        args.min_batch, args.max_batch, args.min_side, args.max_side = 1, 2, 64, 96
        sizes = {"min_size": 64, "max_size": 96}
    w = _workload.run("detection_train", args)
    classes = 11
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=classes, **sizes
    ).to(w.device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    images_seen = 0
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        images, targets = random_targets(w, batch, (args.min_side, args.max_side), classes)
        with w.autocast():
            losses = model(images, targets)
        loss = sum(losses.values())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        images_seen += batch
        del images, targets, losses, loss
    w.finish(f"{args.steps} steps, {images_seen} images")


if __name__ == "__main__":
    main()
