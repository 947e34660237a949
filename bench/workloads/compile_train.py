"""Workload for trace capture: GPT-2-small training compiled with
torch.compile (Inductor, dynamic=True), bf16 autocast and AdamW, batch 8
and a new sequence length in 64..1024 (a multiple of 16) every step.
Inductor plans its own buffer reuse and fuses the pointwise work, so the
requests differ from the same model run eagerly (gpt2_train_varlen). On
the CPU (`--tiny`) it compiles with the aot_eager backend, which needs no
C++ compiler. About 2.3 minutes under scripts/capture_trace.py on an H200
(beside a build):

    python scripts/capture_trace.py -o compile_train.trace.csv.gz -- bench/workloads/compile_train.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt2_model import gpt2, gpt2_config  # noqa: E402


def main():
    p = _workload.parser(__doc__, steps=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.min_len, args.max_len = 2, 16, 64
    w = _workload.run("compile_train", args)

    config = gpt2_config(vocab_size=256, n_ctx=64, n_embd=64, n_layer=2, n_head=4) if args.tiny else gpt2_config()
    model = gpt2(config).to(w.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    compiled = torch.compile(model, dynamic=True, backend="inductor" if w.cuda else "aot_eager")
    tokens = 0
    for _ in range(args.steps):
        length = 16 * w.randint(args.min_len // 16, args.max_len // 16)
        idx = torch.randint(0, config.vocab_size, (args.batch, length + 1), device=w.device)
        with w.autocast():
            logits = compiled(idx[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += args.batch * length
        del logits, loss, idx
    w.finish(f"{args.steps} steps, {tokens} tokens")


if __name__ == "__main__":
    main()
