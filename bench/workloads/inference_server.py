"""Workload for trace capture: a long inference-server loop in which short
and long requests for three models interleave on several streams: GPT-2
generation (HuggingFace GPT2LMHeadModel, GPT-2-small config, dynamic KV
cache; short: batch 1..4, prompt 16..128, 8..24 new tokens; long: batch
8..16, prompt 256..768, 48..96 new tokens), BERT-base encoding (short:
batch 1..8, 16..128 tokens; long: batch 32..64, 256..512 tokens) and
ResNet-50 classification (short: batch 1..8; long: batch 32..64; 224x224).
All random bf16 weights. Each request runs on the next of --streams worker
streams (default 2) while its inputs were made on the default stream (the
worker waits for them); its result is handed back to the default stream
with record_stream and kept a few requests, as a response queue holds it.
A third of the requests are long. About 25-35 s on an H200:

    python scripts/capture_trace.py -o inference_server.trace.csv.gz -- \\
        bench/workloads/inference_server.py --streams 2
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402  (sets the offline variables before transformers loads)
import torch  # noqa: E402
import torchvision  # noqa: E402
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel  # noqa: E402


def build_models(w, tiny):
    dtype = w.dtype()
    if tiny:
        gpt = GPT2Config(vocab_size=256, n_positions=128, n_embd=32, n_layer=2, n_head=2, attn_implementation="sdpa")
        bert = BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=128, attn_implementation="sdpa",
        )
        cnn = torchvision.models.resnet18(weights=None, num_classes=10)
    else:
        gpt = GPT2Config(attn_implementation="sdpa")  # GPT-2 small: 12 layers, 768 wide, 1024 positions
        bert = BertConfig(attn_implementation="sdpa")  # BERT-base
        cnn = torchvision.models.resnet50(weights=None)
    models = {
        "gpt2": GPT2LMHeadModel(gpt).to(device=w.device, dtype=dtype).eval(),
        "bert": BertModel(bert).to(device=w.device, dtype=dtype).eval(),
        "resnet": cnn.to(device=w.device, dtype=dtype).eval(),
    }
    return models, gpt, bert


# (low, high) ranges for short and long requests, per model and field.
SHAPES = {
    "gpt2": {"short": dict(batch=(1, 4), prompt=(16, 128), new=(8, 24)),
             "long": dict(batch=(8, 16), prompt=(256, 768), new=(48, 96))},
    "bert": {"short": dict(batch=(1, 8), length=(16, 128)), "long": dict(batch=(32, 64), length=(256, 512))},
    "resnet": {"short": dict(batch=(1, 8), size=(224, 224)), "long": dict(batch=(32, 64), size=(224, 224))},
}
TINY_SHAPES = {
    "gpt2": {"short": dict(batch=(1, 2), prompt=(4, 8), new=(2, 3)),
             "long": dict(batch=(2, 3), prompt=(8, 16), new=(3, 5))},
    "bert": {"short": dict(batch=(1, 2), length=(4, 8)), "long": dict(batch=(2, 3), length=(8, 16))},
    "resnet": {"short": dict(batch=(1, 2), size=(32, 32)), "long": dict(batch=(2, 3), size=(32, 32))},
}


def main():
    p = _workload.parser(__doc__, steps=60)
    p.add_argument("--streams", type=int, default=2, help="worker streams (2 or more)")
    p.add_argument("--long-fraction", type=float, default=1 / 3)
    p.add_argument("--in-flight", type=int, default=6, help="responses kept before the oldest is dropped")
    args = p.parse_args()
    if args.streams < 2:
        p.error("--streams must be 2 or more")
    w = _workload.run(f"inference_server_{args.streams}streams", args)
    models, gpt, bert = build_models(w, args.tiny)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    workers = [w.stream() for _ in range(args.streams)]
    default = w.current_stream()
    responses = collections.deque()
    served = collections.Counter()

    with torch.inference_mode():
        for request in range(args.steps):
            name = w.choice(sorted(models))
            kind = "long" if w.rng.random() < args.long_fraction else "short"
            shape = {k: w.randint(*v) for k, v in shapes[name][kind].items()}
            # Inputs arrive on the default stream (the host-to-device copy).
            if name == "gpt2":
                inputs = torch.randint(0, gpt.vocab_size, (shape["batch"], shape["prompt"]), device=w.device)
            elif name == "bert":
                inputs = torch.randint(0, bert.vocab_size, (shape["batch"], shape["length"]), device=w.device)
            else:
                inputs = torch.randn(shape["batch"], 3, shape["size"], shape["size"], device=w.device,
                                     dtype=w.dtype())
            worker = workers[request % len(workers)]
            w.wait(worker, default)
            w.record(inputs, worker)
            with w.on(worker):
                if name == "gpt2":
                    result = models[name].generate(
                        input_ids=inputs,
                        attention_mask=torch.ones_like(inputs),
                        max_new_tokens=shape["new"],
                        min_new_tokens=shape["new"],
                        do_sample=False,
                        pad_token_id=0,
                    )
                elif name == "bert":
                    result = models[name](input_ids=inputs).pooler_output
                else:
                    result = models[name](inputs).softmax(dim=-1)
            # The response goes back on the default stream.
            w.wait(default, worker)
            w.record(result, default)
            responses.append(result)
            if len(responses) > args.in_flight:
                responses.popleft()
            served[f"{name} {kind}"] += 1
            del inputs, result
    responses.clear()
    w.finish(f"{args.steps} requests on {args.streams} streams: " + ", ".join(
        f"{served[k]} {k}" for k in sorted(served)))


if __name__ == "__main__":
    main()
