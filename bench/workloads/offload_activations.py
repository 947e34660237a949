"""Workload for trace capture: activation offloading. GPT-2-medium-shaped
training (24 layers, 1024 wide, batch 4, bf16 autocast, AdamW, sequence
length 256..1024 each step) where every activation autograd saves for the backward
pass (above 1 MiB, parameters excluded) is copied to pinned host memory on
an offload stream during the forward pass and copied back on a reload
stream when the backward pass needs it, through
torch.autograd.graph.saved_tensors_hooks, as CPU-offload options of
training frameworks do. The device copy is freed after its offload copy was
queued (record_stream keeps it until the copy is done); reloaded tensors are
allocated on the reload stream and used on the compute stream. Three
streams. About 15-25 s on an H200:

    python scripts/capture_trace.py -o offload_activations.trace.csv.gz -- \\
        bench/workloads/offload_activations.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
from gpt2_model import gpt2, gpt2_config, training_step  # noqa: E402


class offloader:
    """Pack and unpack hooks that move saved activations to pinned host
    memory and back, each on its own stream."""

    def __init__(self, w, model, threshold_bytes):
        self.w = w
        self.threshold_bytes = threshold_bytes
        self.parameters = {p.data_ptr() for p in model.parameters()}
        self.offload_stream = w.stream()
        self.reload_stream = w.stream()
        self.offloaded = 0
        self.reloaded = 0

    def pack(self, tensor):
        # As torchtune's OffloadActivations: small tensors and parameters
        # stay; everything else saved goes to the host (autocast's bf16
        # copies of weights included).
        if (
            (self.w.cuda and tensor.device.type != "cuda")
            or tensor.numel() * tensor.element_size() < self.threshold_bytes
            or tensor.data_ptr() in self.parameters
        ):
            return tensor
        w = self.w
        compute = w.current_stream()
        w.wait(self.offload_stream, compute)
        with w.on(self.offload_stream):
            host = w.pinned_empty(tensor.shape, tensor.dtype)
            host.copy_(tensor, non_blocking=True)
        # Autograd may drop the device tensor before the copy has run.
        w.record(tensor, self.offload_stream)
        self.offloaded += 1
        return (host, tensor.device)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        w = self.w
        compute = w.current_stream()
        w.wait(self.reload_stream, self.offload_stream)
        with w.on(self.reload_stream):
            tensor = host.to(device, non_blocking=True)
        w.wait(compute, self.reload_stream)
        w.record(tensor, compute)
        self.reloaded += 1
        return tensor


def main():
    p = _workload.parser(__doc__, steps=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--threshold-mb", type=float, default=1.0, help="offload saved tensors at least this large")
    args = p.parse_args()
    config = gpt2_config(n_layer=24, n_embd=1024, n_head=16)
    if args.tiny:
        args.batch, args.min_len, args.max_len, args.threshold_mb = 2, 8, 32, 0.001
        config = gpt2_config(vocab_size=256, n_ctx=64, n_embd=32, n_layer=2, n_head=2)
    w = _workload.run("offload_activations", args)

    model = gpt2(config).to(w.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    hooks = offloader(w, model, int(args.threshold_mb * 2**20))
    for _ in range(args.steps):
        length = w.randint(args.min_len, args.max_len)
        tokens = torch.randint(0, config.vocab_size, (args.batch, length + 1), device=w.device)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            loss = training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]) if w.cuda else cpu_step(
                model, optimizer, tokens
            )
        del tokens
    w.finish(f"{args.steps} steps, {hooks.offloaded} tensors offloaded, {hooks.reloaded} reloaded, "
             f"last loss {loss.item():.3f}")


def cpu_step(model, optimizer, tokens):
    """gpt2_model.training_step without CUDA autocast, for the CPU smoke run."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


if __name__ == "__main__":
    main()
