"""Workload for trace capture: GAN training, two models and two optimizers
taking turns: a DCGAN-style generator and discriminator (transposed and
strided convolutions with batch norm, about 50M parameters together) at a
resolution that grows in stages (64, 128, then 256 px, as progressive
training does) with a batch of 16..96 drawn every step; each step trains
the discriminator on real and detached fake images, then the generator
through the discriminator, fp32 with Adam. About 15-30 s on an H200:

    python scripts/capture_trace.py -o gan_train.trace.csv.gz -- bench/workloads/gan_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def generator(latent, width, levels):
    """latent x 1 x 1 -> 3 x 2^(levels+2) px."""
    layers = [nn.ConvTranspose2d(latent, width, 4, 1, 0, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)]
    for _ in range(levels):
        out = max(width // 2, 32)
        layers += [nn.ConvTranspose2d(width, out, 4, 2, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(True)]
        width = out
    layers += [nn.Conv2d(width, 3, 3, 1, 1), nn.Tanh()]
    return nn.Sequential(*layers)


def discriminator(width, levels):
    """3 x any px -> one logit per image."""
    layers = [nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2, True)]
    channels = 32
    for _ in range(levels):
        out = min(channels * 2, width)
        layers += [nn.Conv2d(channels, out, 4, 2, 1, bias=False), nn.BatchNorm2d(out), nn.LeakyReLU(0.2, True)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 1)]
    return nn.Sequential(*layers)


def main():
    p = _workload.parser(__doc__, steps=36)
    p.add_argument("--min-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=96)
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args()
    stages = [4, 5, 6]  # generator levels: 64, 128, 256 px
    if args.tiny:
        args.min_batch, args.max_batch, args.width = 2, 4, 64
        stages = [1, 2]
    w = _workload.run("gan_train", args)

    latent = 128
    images = 0
    per_stage = max(1, args.steps // len(stages))
    for step in range(args.steps):
        levels = stages[min(step // per_stage, len(stages) - 1)]
        if step % per_stage == 0 and step // per_stage < len(stages):
            # A new stage: larger models, new optimizers (the old ones are freed).
            g = generator(latent, args.width, levels).to(w.device)
            d = discriminator(args.width, levels).to(w.device)
            opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
            opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
        batch = w.randint(args.min_batch, args.max_batch)
        side = 2 ** (levels + 2)
        real = torch.rand(batch, 3, side, side, device=w.device) * 2 - 1
        z = torch.randn(batch, latent, 1, 1, device=w.device)
        fake = g(z)
        ones = torch.ones(batch, 1, device=w.device)
        zeros = torch.zeros(batch, 1, device=w.device)
        loss_d = (F.binary_cross_entropy_with_logits(d(real), ones)
                  + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        opt_d.step()
        loss_g = F.binary_cross_entropy_with_logits(d(fake), ones)
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        images += batch
        del real, z, fake, ones, zeros
    w.finish(f"{args.steps} steps, {images} images, last losses {loss_d.item():.3f} / {loss_g.item():.3f}")


if __name__ == "__main__":
    main()
