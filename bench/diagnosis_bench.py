#!/usr/bin/env python3
"""What streamalloc's diagnosis costs on a training step: GPT-2 small
(bench/workloads/gpt2_model.py, bf16 autocast, AdamW) under streamalloc,
each mode in its own process:

  off        tagging off (the one relaxed load per allocation and free)
  tags       enable_tagging(); tag() scopes around forward+backward and
             the optimizer step: every allocation recorded
  attribute  tags, plus attribute(model): module hooks in forward and
             backward on every submodule, every step
  sampled    tags, with enable_tagging(sample_every=16): one small
             allocation in 16 recorded (1 MiB and larger always), and
             attribute(model, sample_passes=16): module hooks in one step
             in 16, only a pass counter on the model in the others
  watch      sampled, plus watch(steps=5).step() per step

Why sample_passes=16: a hooked step costs about what "attribute" adds to
a step (2-26% in bench/RESULTS.md's runs); spread over 16 steps that is
at most 1.6%, within the 2% budget together with recording allocations
(which cost nothing measurable in those runs), and the module breakdown
still refreshes every 16 steps (under a second here). With the default --steps and --step-warmup, each timed window of
20 steps holds one sampled pass (passes 0, 16 and 32: the first step, a
synchronized one and a back-to-back one): the back-to-back mean counts
it at 1/20 instead of 1/16, the median leaves it out. The JSON records
the passes and how many were sampled.

    python bench/diagnosis_bench.py [--json FILE] [--modes off,tags,...]

The modes of each round run in rotated order; samples of all rounds are
pooled. It prints a markdown table (median [p10, p90] per step between two
synchronizations, back-to-back ms per step, overhead against "off") and
writes JSON. Step timing as in bench/python_bench.py (time_steps).
"""

import argparse
import json
import os
import sys
import time

from _driver import check_choices, finish, run_worker
from python_bench import log, summarize, time_steps

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["off", "tags", "attribute", "sampled", "watch"]


def worker(mode, out_path, args):
    import streamalloc

    streamalloc.install()
    import torch

    sys.path.insert(0, os.path.join(HERE, "workloads"))
    from gpt2_model import make_training

    model, optimizer = make_training(seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), device="cuda")
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    leak_watch = None
    attribution = None
    sampled = mode in ("sampled", "watch")
    if mode != "off":
        streamalloc.enable_tagging(sample_every=16 if sampled else 1)
    if mode in ("attribute", "sampled", "watch"):
        attribution = streamalloc.attribute(model, sample_passes=16 if sampled else 1)
    if mode == "watch":
        leak_watch = streamalloc.watch(steps=5, warn=False)
    scoped = mode != "off"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if scoped:
                with streamalloc.tag("train"):
                    logits = model(idx)
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                    loss.backward()
            else:
                logits = model(idx)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                loss.backward()
        if scoped:
            with streamalloc.tag("optimizer"):
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if leak_watch is not None:
            leak_watch.step()

    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    torch.cuda.synchronize()
    allocations_per_step = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    timing = time_steps(torch, step, args.step_warmup, args.steps)
    result = {"mode": mode, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
              "batch": args.batch, "seq_len": args.seq_len, "allocations_per_step": allocations_per_step, **timing}
    if leak_watch is not None:
        result["leak_findings"] = [f.as_dict() for f in leak_watch.findings]
    if sampled:
        result.update(passes=attribution.passes, sampled_passes=attribution.sampled_passes)
    log(f"diagnosis mode {mode}: median {timing['ms_per_step']['median']:.2f} ms per step")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def merge(mode, rounds):
    failed = [r for r in rounds if "error" in r]
    if failed:
        return {"mode": mode, "error": failed[0]["error"]}
    samples = [x for r in rounds for x in r["samples"]]
    merged = {k: v for k, v in rounds[0].items() if k not in ("samples", "ms_per_step", "back_to_back_ms")}
    merged.update(ms_per_step=summarize(samples), samples=samples,
                  back_to_back_ms=summarize([r["back_to_back_ms"] for r in rounds]), rounds=len(rounds))
    return merged


def print_table(results, modes):
    ok = {m: r for m, r in results.items() if "error" not in r}
    first = next(iter(ok.values()), {})
    print(f"## Diagnosis overhead (bench/diagnosis_bench.py) on {first.get('device', '?')}, torch {first.get('torch', '?')}")
    print()
    print(f"GPT-2 small training step, batch {first.get('batch')}, seq {first.get('seq_len')}, bf16 autocast, AdamW; "
          f"{first.get('allocations_per_step', '?')} allocations per step; {first.get('rounds', 1)} rounds.")
    print()
    print("| mode | ms per step, median [p10, p90] | back to back, ms per step | overhead vs off (median, back to back) |")
    print("|---|---|---|---|")
    base = ok.get("off")
    for mode in modes:
        r = results[mode]
        if "error" in r:
            print(f"| {mode} | failed: {r['error']} | | |")
            continue
        s = r["ms_per_step"]
        b = r["back_to_back_ms"]["median"]
        overhead = "-"
        if base is not None and mode != "off":
            overhead = (f"{(s['median'] / base['ms_per_step']['median'] - 1) * 100:+.2f}%, "
                        f"{(b / base['back_to_back_ms']['median'] - 1) * 100:+.2f}%")
        print(f"| {mode} | {s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}] | {b:.2f} | {overhead} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="few steps: checks the script, not the numbers")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.step_warmup, args.rounds = 3, 1, 1
    if args.worker:
        worker(args.worker, args.out, args)
        return 0
    modes = args.modes.split(",")
    check_choices(parser, "mode", modes, MODES)
    passthrough = [f"--steps={args.steps}", f"--step-warmup={args.step_warmup}", f"--batch={args.batch}",
                   f"--seq-len={args.seq_len}"]
    rounds = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            log(f"round {r + 1}/{args.rounds}: mode {mode}")
            start = time.perf_counter()
            out = run_worker(__file__, mode, passthrough, args.timeout)
            out["wall_s"] = round(time.perf_counter() - start, 1)
            rounds[mode].append(out)
    results = {m: merge(m, rs) for m, rs in rounds.items()}
    print_table(results, modes)
    return finish("diagnosis_bench", modes, results, args.json)


if __name__ == "__main__":
    sys.exit(main())
