"""Workload for trace capture: the memory traffic of FSDP2 (fully_shard)
training, simulated on one GPU. Each of 12 transformer layers (1536 wide)
keeps its parameters as one flat fp32 shard, 1/8 of the layer as if on rank
0 of 8. Before a layer runs, its shard is cast to bf16 into an all-gather
input buffer (the copy-in) and "all-gathered" into a full bf16 buffer on a
side stream (each rank's part written by a copy, as NCCL would), one layer
ahead of compute, as FSDP2 prefetches; the compute stream waits for it,
record_stream marks the buffer used there, and it is freed when the layer
is done (resharded). The backward pass gathers again in reverse order,
recomputes each layer (activation checkpointing per layer, as FSDP is
usually run), and reduce-scatters the flat bf16 gradient into an fp32 shard
gradient on another side stream (one micro-batch: no accumulation). AdamW updates the shards. Sequence length
256..1024 each step, batch 8.

--streams 2: compute + one side stream for copy-in and all-gather (the
reduce-scatter on the compute stream); --streams 4: compute, copy-in,
all-gather and reduce-scatter each on their own stream. About 10-15 s on an
H200:

    python scripts/capture_trace.py -o fsdp2_streams2.trace.csv.gz -- \\
        bench/workloads/fsdp2_streams.py --streams 2
    python scripts/capture_trace.py -o fsdp2_streams4.trace.csv.gz -- \\
        bench/workloads/fsdp2_streams.py --streams 4
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def layer_shapes(width):
    """Name and shape of each parameter of a pre-norm transformer layer."""
    return [
        ("ln_1.weight", (width,)),
        ("ln_1.bias", (width,)),
        ("qkv.weight", (3 * width, width)),
        ("proj.weight", (width, width)),
        ("ln_2.weight", (width,)),
        ("ln_2.bias", (width,)),
        ("fc_1.weight", (4 * width, width)),
        ("fc_2.weight", (width, 4 * width)),
    ]


def unflatten(flat, shapes):
    """Views of the flat unsharded buffer, one per parameter."""
    views, offset = {}, 0
    for name, shape in shapes:
        count = math.prod(shape)
        views[name] = flat[offset : offset + count].view(shape)
        offset += count
    return views


def layer_forward(x, p, heads):
    batch, length, width = x.shape
    h = F.layer_norm(x, (width,), p["ln_1.weight"], p["ln_1.bias"])
    q, k, v = F.linear(h, p["qkv.weight"]).split(width, dim=2)
    q, k, v = (t.view(batch, length, heads, -1).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(y.transpose(1, 2).reshape(batch, length, width), p["proj.weight"])
    h = F.layer_norm(x, (width,), p["ln_2.weight"], p["ln_2.bias"])
    return x + F.linear(F.gelu(F.linear(h, p["fc_1.weight"]), approximate="tanh"), p["fc_2.weight"])


class sharded_layers:
    """Flat fp32 shards and the streams that gather and reduce them."""

    def __init__(self, w, layers, width, world, streams):
        self.w = w
        self.world = world
        self.shapes = layer_shapes(width)
        numel = sum(math.prod(shape) for _, shape in self.shapes)
        self.padded = -(-numel // world) * world  # FSDP pads the flat parameter to a multiple of the world size
        self.shards = []
        for _ in range(layers):
            shard = torch.empty(self.padded // world, device=w.device)
            torch.nn.init.normal_(shard, std=0.02)
            self.shards.append(torch.nn.Parameter(shard))
        self.compute = w.current_stream()
        if streams == 4:
            self.copy_in, self.gather, self.reduce = w.stream(), w.stream(), w.stream()
        else:
            self.copy_in = self.gather = w.stream()
            self.reduce = self.compute
        self.dtype = w.dtype()

    def all_gather(self, i):
        """Layer i's unsharded bf16 parameters, gathered on the side
        stream(s); the caller makes the compute stream wait before use."""
        w = self.w
        w.wait(self.copy_in, self.compute)  # the optimizer wrote the shards on the compute stream
        with w.on(self.copy_in):
            gather_input = self.shards[i].detach().to(self.dtype)
        w.wait(self.gather, self.copy_in)
        with w.on(self.gather):
            full = torch.empty(self.padded, dtype=self.dtype, device=w.device)
            for rank in range(self.world):  # rank 0's part and, standing in for the others, the same bytes
                full[rank * gather_input.numel() : (rank + 1) * gather_input.numel()].copy_(gather_input)
        if self.gather is not self.copy_in:
            w.record(gather_input, self.gather)
        return full

    def use(self, full):
        """The compute stream waits for the gather and marks the buffer used."""
        self.w.wait(self.compute, self.gather)
        self.w.record(full, self.compute)
        return unflatten(full, self.shapes)

    def reduce_scatter(self, i, flat_grad):
        """Sums the flat gradient's world parts into layer i's fp32 shard
        gradient, on the reduce-scatter stream."""
        w = self.w
        w.wait(self.reduce, self.compute)
        with w.on(self.reduce):
            # FSDP2's foreach_reduce: the gradient is copied into a
            # reduce-scatter input buffer, reduced in bf16 to this rank's
            # part, then cast up to the fp32 shard gradient.
            reduce_input = torch.empty_like(flat_grad)
            reduce_input.copy_(flat_grad)
            reduced = reduce_input.view(self.world, -1).sum(dim=0)
            del reduce_input
            shard_grad = reduced.float().div_(self.world)
            del reduced
        if self.reduce is not self.compute:
            w.record(flat_grad, self.reduce)
            w.record(shard_grad, self.compute)  # the optimizer reads it on the compute stream
        self.shards[i].grad = shard_grad


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--streams", type=int, choices=[2, 4], default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--world", type=int, default=8, help="simulated ranks: each shard is 1/world of a layer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    args = p.parse_args()
    width, heads = 1536, 16
    if args.tiny:
        args.layers, args.batch, args.min_len, args.max_len = 3, 2, 8, 16
        width, heads = 32, 2
    w = _workload.run(f"fsdp2_streams{args.streams}", args)

    model = sharded_layers(w, args.layers, width, args.world, args.streams)
    optimizer = torch.optim.AdamW(model.shards, lr=1e-4, weight_decay=0.1)
    last = args.layers - 1
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        x = torch.randn(args.batch, length, width, device=w.device, dtype=model.dtype)
        inputs = []
        # Forward: gather layer i + 1 while layer i computes.
        pending = model.all_gather(0)
        with torch.no_grad():
            for i in range(args.layers):
                params = model.use(pending)
                pending = model.all_gather(i + 1) if i < last else None
                inputs.append(x)
                x = layer_forward(x, params, heads)
                del params
        # A stand-in loss on the output: its gradient starts the backward pass.
        grad = (2.0 / x.numel()) * x.float()
        grad = grad.to(model.dtype)
        loss = x.float().pow(2).mean()
        del x
        # Backward: gather again in reverse, recompute, reduce-scatter.
        pending = model.all_gather(last)
        for i in reversed(range(args.layers)):
            full = pending
            pending = model.all_gather(i - 1) if i > 0 else None
            flat = full.detach().requires_grad_()
            del full
            params = model.use(flat)
            layer_input = inputs.pop().requires_grad_()
            out = layer_forward(layer_input, params, heads)
            torch.autograd.backward(out, grad)
            grad = layer_input.grad
            flat_grad = flat.grad
            del out, params, flat, layer_input
            model.reduce_scatter(i, flat_grad)
            del flat_grad
        del grad
        w.wait(model.compute, model.reduce)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    w.finish(f"{args.steps} steps, {args.layers} layers sharded {args.world} ways, {args.streams} streams, "
             f"last loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
