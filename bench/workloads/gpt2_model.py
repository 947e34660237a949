"""The GPT-2-style transformer in plain torch, defined once for the benchmark
workloads (training with random sequence lengths, generation with growing
KV caches), bench/python_bench.py and the GPU tests
(tests/python/scripts/train.py and ddp_train.py load this file by path).
Random init: what is measured is memory, time and agreement between
allocators, not quality.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class gpt2_config:
    """GPT-2 small by default. deterministic_attention spells attention out
    with a causal mask instead of calling scaled_dot_product_attention,
    whose fused backward kernels are not deterministic (the tests compare
    losses bit for bit)."""

    vocab_size: int = 50257
    n_ctx: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    tied_head: bool = True  # lm_head shares the token embedding's weight, as in GPT-2
    scaled_residual_init: bool = True  # GPT-2's smaller init of the residual projections
    deterministic_attention: bool = False


class causal_self_attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        mask = None
        if config.deterministic_attention:
            # True where a query would see a later position.
            mask = torch.triu(torch.ones(config.n_ctx, config.n_ctx, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, cache=None):
        """With `cache` (a [k, v] list, grown in place by torch.cat the way
        simple generation loops do), attends to every cached position."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        causal = True
        if cache is not None:
            if cache[0] is not None:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
                # One new position attends to all earlier ones.
                causal = length > 1
            cache[0], cache[1] = k, v
        if self.mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            y = self._masked_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))

    def _masked_attention(self, q, k, v):
        """Softmax attention with the mask, softmax in float32; the queries
        are the last q.shape[2] of the k.shape[2] positions."""
        queries, keys = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores.masked_fill(self.mask[keys - queries : keys, :keys], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return weights @ v


class block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = causal_self_attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class gpt2(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config or gpt2_config()
        c = self.config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_ctx, c.n_embd)
        self.blocks = nn.ModuleList(block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tied_head:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        if c.scaled_residual_init:
            for name, p in self.named_parameters():
                if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, caches=None, start=0):
        """Logits for token ids `idx` (batch, length) at positions
        start..start+length; `caches` is one [k, v] list per layer."""
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for i, layer in enumerate(self.blocks):
            x = layer(x, None if caches is None else caches[i])
        return self.lm_head(self.ln_f(x))


@torch.inference_mode()
def decode(model, prompt, new_tokens, pick):
    """`new_tokens` tokens after `prompt` (batch, length), each chosen by
    `pick` from the last position's logits (batch, vocab), with one [k, v]
    cache per layer grown by torch.cat a token at a time."""
    caches = [[None, None] for _ in model.blocks]
    logits = model(prompt, caches, start=0)
    position = prompt.shape[1]
    out = [pick(logits[:, -1])]
    for _ in range(new_tokens - 1):
        logits = model(out[-1], caches, start=position)
        position += 1
        out.append(pick(logits[:, -1]))
    return torch.cat(out, dim=1)


def training_step(model, optimizer, idx, targets):
    """One bf16-autocast training step; returns the loss tensor."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def make_training(device="cuda", seed=0, config=None):
    """A fresh model (GPT-2 small unless `config` says otherwise) and its
    AdamW optimizer on `device`."""
    torch.manual_seed(seed)
    model = gpt2(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return model, optimizer
