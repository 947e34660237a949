"""Workload for trace capture: ResNet-50 training at a fixed batch of 64
(bf16 autocast, SGD with momentum), the steady loop of a training job in
which every iteration allocates the same blocks. Runs in about 15 seconds on
an H200:

    python scripts/capture_trace.py -o resnet50_fixed_batch.trace.csv.gz -- \\
        bench/workloads/resnet50_train_fixed.py
"""

import argparse

import torch
import torchvision


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch,), device="cuda")
    for _ in range(args.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"resnet50_train_fixed: {args.steps} steps of batch {args.batch}, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
