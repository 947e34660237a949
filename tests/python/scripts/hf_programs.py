"""Two HuggingFace programs under one allocator (argv[1], as
select_allocator), on a small Llama built from a config (random weights,
nothing downloaded): eight `Trainer` steps in bf16 with gradient
checkpointing over batches of varying length, and greedy `generate()` with
a static KV cache, eager and then with the forward compiled in
"reduce-overhead" mode (CUDA graph trees), three times.

Prints the losses, the generated tokens and the peaks; without the
transformers package, only {"transformers": null, "reason": ...}.
"""

import os
import sys

# cuBLAS reads this when it first initialises; deterministic mode needs it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import tempfile  # noqa: E402

import torch  # noqa: E402

from _common import emit, select_allocator  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "native"
select_allocator(MODE)
try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
except ImportError as error:
    emit({"transformers": None, "reason": f"no transformers: {error}"})
    sys.exit(0)
torch.use_deterministic_algorithms(True)

VOCAB = 2048
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)


class VaryingLengthTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (64 + (i * 37) % 192,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def pad(batch):
    longest = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).cuda()
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps=8, logging_steps=1,
                                 report_to=[], bf16=True, save_strategy="no", seed=0, data_seed=0,
                                 gradient_checkpointing=True)
        trainer = Trainer(model=model, args=args, train_dataset=VaryingLengthTokens(), data_collator=pad)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def generate():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).cuda().eval()
    prompts = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(7)).cuda()

    def run():
        return model.generate(prompts, max_new_tokens=32, do_sample=False, cache_implementation="static")

    eager = run()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    compiled = [run() for _ in range(3)]
    return eager.tolist(), [tokens.tolist() for tokens in compiled]


losses = train()
peaks = {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
eager_tokens, compiled_tokens = generate()
emit({
    "transformers": transformers.__version__,
    "allocator": torch.cuda.memory.get_allocator_backend(),
    "losses": losses,
    "train": peaks,
    "eager_tokens": eager_tokens,
    "compiled_tokens": compiled_tokens,
})
