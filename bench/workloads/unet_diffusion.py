"""Workload for trace capture: a small diffusion-style UNet (three
resolutions of 128/256/512 channels, two residual blocks with a timestep
embedding at each, self-attention at the lowest resolution, skip
connections) trained to predict noise with bf16 autocast and AdamW, on
latent-sized images whose shape changes every step as aspect-ratio
bucketing does (64x64, 48x80, 80x48, 56x72, 72x56; batch 16..32), followed
by a 20-step sampling loop at batch 8 under inference mode. About 10-20 s on
an H200:

    python scripts/capture_trace.py -o unet_diffusion.trace.csv.gz -- bench/workloads/unet_diffusion.py
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class res_block(nn.Module):
    def __init__(self, channels_in, channels_out, time_dim):
        super().__init__()
        self.norm_1 = nn.GroupNorm(32, channels_in)
        self.conv_1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.time = nn.Linear(time_dim, channels_out)
        self.norm_2 = nn.GroupNorm(32, channels_out)
        self.conv_2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else nn.Identity()

    def forward(self, x, t):
        h = self.conv_1(F.silu(self.norm_1(x)))
        h = h + self.time(t)[:, :, None, None]
        h = self.conv_2(F.silu(self.norm_2(h)))
        return h + self.skip(x)


class attention(nn.Module):
    def __init__(self, channels, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(32, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        y = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(y.transpose(-1, -2).reshape(b, c, h, w))


class unet(nn.Module):
    def __init__(self, channels=(128, 256, 512), in_channels=4, blocks=2, heads=8):
        super().__init__()
        time_dim = 4 * channels[0]
        self.base = channels[0]
        self.time_mlp = nn.Sequential(nn.Linear(channels[0], time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))
        self.stem = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        skips = [channels[0]]
        current = channels[0]
        for level, width in enumerate(channels):
            for _ in range(blocks):
                self.down.append(res_block(current, width, time_dim))
                current = width
                skips.append(current)
            if level + 1 < len(channels):
                self.down.append(nn.Conv2d(current, current, 3, stride=2, padding=1))
                skips.append(current)
        self.mid_1 = res_block(current, current, time_dim)
        self.mid_attn = attention(current, heads)
        self.mid_2 = res_block(current, current, time_dim)
        self.up = nn.ModuleList()
        for level, width in reversed(list(enumerate(channels))):
            for _ in range(blocks + 1):
                self.up.append(res_block(current + skips.pop(), width, time_dim))
                current = width
            if level > 0:
                self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
        self.out = nn.Sequential(nn.GroupNorm(32, current), nn.SiLU(), nn.Conv2d(current, in_channels, 3, padding=1))

    def forward(self, x, t):
        t = self.time_mlp(timestep_embedding(t, self.base))
        h = self.stem(x)
        saved = [h]
        for layer in self.down:
            h = layer(h, t) if isinstance(layer, res_block) else layer(h)
            saved.append(h)
        h = self.mid_2(self.mid_attn(self.mid_1(h, t)), t)
        for layer in self.up:
            if isinstance(layer, res_block):
                h = layer(torch.cat([h, saved.pop()], dim=1), t)
            else:
                h = layer(h)
        return self.out(h)


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--min-batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--buckets", default="64x64,48x80,80x48,56x72,72x56", help="latent shapes HxW (multiples of 8)")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--sample-batch", type=int, default=8)
    args = p.parse_args()
    channels = (128, 256, 512)
    if args.tiny:
        args.min_batch, args.max_batch, args.buckets, args.sample_steps, args.sample_batch = 1, 2, "8x8,8x16", 2, 1
        channels = (32, 64, 64)
    w = _workload.run("unet_diffusion", args)
    buckets = [tuple(int(v) for v in b.split("x")) for b in args.buckets.split(",")]

    model = unet(channels=channels, heads=2 if args.tiny else 8).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    timesteps = 1000
    alphas = torch.cos(torch.linspace(0, math.pi / 2 * 0.999, timesteps, device=w.device)) ** 2  # cumulative
    for _ in range(args.steps):
        batch = w.randint(args.min_batch, args.max_batch)
        height, width = w.choice(buckets)
        latents = torch.randn(batch, 4, height, width, device=w.device)
        noise = torch.randn_like(latents)
        t = torch.randint(0, timesteps, (batch,), device=w.device)
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        with w.autocast():
            loss = F.mse_loss(model(noisy, t).float(), noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del latents, noise, noisy, a, t

    # DDIM-style deterministic sampling.
    model.eval()
    height, width = buckets[0]
    with torch.inference_mode(), w.autocast():
        x = torch.randn(args.sample_batch, 4, height, width, device=w.device)
        steps = torch.linspace(timesteps - 1, 0, args.sample_steps, device=w.device).long().tolist()
        for i, step in enumerate(steps):
            t = torch.full((args.sample_batch,), step, device=w.device, dtype=torch.long)
            eps = model(x, t).float()
            a = alphas[step]
            a_next = alphas[steps[i + 1]] if i + 1 < len(steps) else torch.ones((), device=w.device)
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
            x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
    w.finish(f"{args.steps} training steps, {args.sample_steps} sampling steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
