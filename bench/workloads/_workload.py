"""What the trace-corpus workloads share: command-line basics, seeds, no
network, the device and its side streams, and the closing summary line.

Every workload runs on a GPU under scripts/capture_trace.py; with
`--device cpu --tiny` it runs the same code path on the CPU with a tiny
model (streams, events and pinned memory become no-ops), which is how the
scripts are checked on machines without a GPU.
"""

import argparse
import contextlib
import os
import random
import time

# Models are built from configs with random weights; nothing may touch the
# network (the capture machine has none). Set before transformers loads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def parser(doc, steps):
    """An argument parser with the options every workload has: --steps
    (default `steps`), --seed, --device and --tiny."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help=f"steps or requests (default {steps})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run, with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and small inputs, for a CPU smoke run")
    return p


def llama_config(tiny, tiny_positions):
    """The Llama of the HF workloads: about 160M parameters, or a tiny one
    for CPU smoke runs with `tiny_positions` positions."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=tiny_positions, attn_implementation="sdpa",
        )
    return LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=2048, attn_implementation="sdpa",
    )


class run:
    """The run of one workload: seeds everything, checks the device, and
    gives side streams and pinned memory that do nothing on the CPU.

        w = run("moe_train", args)
        ...
        w.finish(f"{n} steps")
    """

    def __init__(self, name, args):
        self.name = name
        self.args = args
        self.rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit(f"{name}: torch sees no CUDA device (use --device cpu --tiny for a smoke run)")
        if self.cuda:
            torch.cuda.manual_seed_all(args.seed)
        self.start = time.perf_counter()

    def randint(self, low, high):
        """A number in low..high (both included) from the run's own
        generator, so sizes repeat from run to run."""
        return self.rng.randint(low, high)

    def choice(self, options):
        return self.rng.choice(options)

    def stream(self):
        """A new side stream (None on the CPU)."""
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    @staticmethod
    def on(stream):
        """Context in which work goes to `stream` (nothing on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def wait(waiter, producer):
        """`waiter` waits for the work queued so far on `producer`."""
        if waiter is not None and producer is not None:
            waiter.wait_stream(producer)

    @staticmethod
    def record(tensor, stream):
        """Tensor.record_stream: the tensor's block is not reused until the
        work queued on `stream` so far has finished."""
        if stream is not None:
            # On a detached alias (same storage, same block): autograd has
            # nothing to say about it, whether or not `tensor` requires grad.
            tensor.detach().record_stream(stream)

    def pinned_empty(self, shape, dtype):
        """Page-locked host memory (plain host memory on the CPU)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def autocast(self):
        """bf16 autocast on the GPU; off on the CPU, where it would only be slow."""
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def causal_lm_step(self, model, optimizer, tokens):
        """One training step of a causal language model on `tokens` (the
        inputs are the labels); returns the loss."""
        with self.autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def dtype(self):
        """Weights and activations for inference: bf16 on the GPU, fp32 on the CPU."""
        return torch.bfloat16 if self.cuda else torch.float32

    def finish(self, what):
        """Waits for the GPU and prints one summary line."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            memory = (
                f", peak allocated {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB, "
                f"peak reserved {torch.cuda.max_memory_reserved(self.device) / 2**30:.2f} GiB"
            )
        else:
            memory = ""
        print(f"{self.name}: {what}, {time.perf_counter() - self.start:.1f} s{memory}", flush=True)
