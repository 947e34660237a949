#!/usr/bin/env python3
"""Python-level allocator benchmark: `torch.empty(n, device="cuda")` + `del`
per pair, one training step of GPT-2 small (plain torch, bf16 autocast,
AdamW), of torchvision's ResNet-50 (random init, bf16 autocast, SGD) and of
a HuggingFace Llama (the corpus workloads' ~160M-parameter LlamaConfig,
random weights, bf16 autocast, AdamW, loss from labels), and
one generation request of GPT-2 small (bf16 weights, greedy, KV caches grown
by torch.cat one token at a time), each under four allocators, every one in
its own process:

  native       torch's default caching allocator
  expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cuda_async   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  streamalloc  `import streamalloc; streamalloc.install()` before any CUDA
               allocation, default settings (STREAMALLOC_CONF unset); the
               package must be importable (PYTHONPATH)

    python bench/python_bench.py [--json FILE] [--modes native,streamalloc]
        [--parts empty_del,gpt2_train_step] [--cpu N]

The driver runs this same script once per mode and round (--worker MODE),
the modes of each round in a rotated order so that a slow spell of the
machine does not fall on one mode only, pools the samples of all rounds,
prints markdown tables (medians, [p10, p90]) and writes JSON. --cpu pins
every worker to one CPU, so that processes differ less in speed.

`torch.empty(0)` calls the allocator but asks it for no memory: its time
is torch's per-tensor work and the allocator's entry. Each repetition
times every size in turn, so a size's time less the 0 B time of the same
repetition is what finding and returning the memory costs, which the
host's speed, drifting during a process and differing between processes,
does not move. A CPU `torch.empty(0)` timed in the same repetitions runs
the same code under every mode: it shows how fast each mode's processes
ran.

A training step (or generation request) is timed two ways: each step
between two synchronizations (the host's launch time counts whenever it
exceeds the GPU's), and steps
issued back to back with one synchronization at the end (what a training
loop sees). Besides the pooled figures, each round's streamalloc figure is
set against native's of the same round: the host's speed drifts between
processes by more than 1%, and a round's modes ran moments apart. For
streamalloc, the allocator's counters of device calls and stream
synchronizations during the timed steps are reported too.
"""

import argparse
import json
import math
import os
import signal
import sys
import time

from _driver import TORCH_MODE_CONF, check_choices, enter_mode, finish, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["native", "expandable", "cuda_async", "streamalloc"]
# (label, float32 elements). "0 B" calls the allocator for no memory: the
# baseline of the allocator's share (module docstring).
EMPTY_SIZES = [("0 B", 0), ("256 B", 64), ("64 KiB", 16 << 10), ("4 MiB", 1 << 20), ("64 MiB", 16 << 20)]
BASELINE = "0 B"
# torch.empty(0) on the CPU: the same code under every mode, so a mode whose
# processes are slower here too ran on a slower host, not a slower allocator.
CONTROL = "CPU control"


def summarize(values):
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return None

    def rank(fraction):  # nearest rank
        return ordered[min(n, max(1, math.ceil(fraction * n))) - 1]

    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"median": median, "p10": rank(0.10), "p90": rank(0.90), "min": ordered[0], "max": ordered[-1], "n": n}


# ---------------------------------------------------------------- worker


def log(message):
    print(f"python_bench[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def memory_peaks(torch):
    """Peak allocated/reserved bytes, or None where the allocator in use
    does not report them."""
    try:
        return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
    except RuntimeError as error:
        return {"error": str(error).splitlines()[0]}


def reset_memory(torch):
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        torch.cuda.reset_peak_memory_stats()
    except RuntimeError:
        pass


def bench_empty_del(torch, reps, warmup, iterations):
    """Each repetition times every size in turn, then the CPU control, so
    that a size and the 0 B baseline of one repetition ran moments apart:
    their difference is the allocator's share even while the host's speed
    drifts during the process."""
    samples = {label: [] for label, _ in EMPTY_SIZES}
    control = []

    def burst(device, numel):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            x = torch.empty(numel, device=device)
            del x
        return (time.perf_counter_ns() - start) / iterations

    for rep in range(warmup + reps):
        times = {}
        for label, numel in EMPTY_SIZES:
            times[label] = burst("cuda", numel)
            torch.cuda.synchronize()
        control_ns = burst("cpu", 0)
        if rep >= warmup:
            for label, ns in times.items():
                samples[label].append(ns)
            control.append(control_ns)
    results = {}
    for label, _ in EMPTY_SIZES:
        results[label] = {"ns_per_pair": summarize(samples[label]), "samples": samples[label],
                          "iterations": iterations, "reps": reps}
        log(f"empty+del {label}: median {results[label]['ns_per_pair']['median']:.0f} ns")
    results[CONTROL] = {"ns_per_pair": summarize(control), "samples": control, "iterations": iterations, "reps": reps}
    return results


# streamalloc counters that show slow-path work: device calls and waits.
SLOW_PATH_COUNTERS = ("num_device_alloc", "num_device_free", "vmm.num_chunk_maps", "vmm.num_chunk_unmaps",
                      "vmm.num_stitched_blocks", "vmm.num_stitch_syncs", "num_sync_all_streams", "num_alloc_retries")


def slow_path_counters():
    if "streamalloc" not in sys.modules:
        return None
    stats = sys.modules["streamalloc"].stats()
    return {name: stats.get(name, 0) for name in SLOW_PATH_COUNTERS}


def time_steps(torch, step, warmup, steps):
    """Runs `step` warmup + steps times, each between two synchronizations,
    then `steps` more back to back with one synchronization at the end.
    Returns the per-step milliseconds of the synchronized steps, the host's
    share of each (until `step` returns, before the synchronization waits
    for the device), the mean of the back-to-back ones, and (streamalloc)
    the counter deltas over both.
    Python's cycle collector is off while steps run and collects between
    the synchronized ones, untimed: a collection inside a step would add
    its pause to whichever mode it fell on."""
    import gc

    times = []
    host = []
    before = None
    gc.disable()
    try:
        for i in range(warmup + steps):
            if i == warmup:
                before = slow_path_counters()
            gc.collect()
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            queued = time.perf_counter()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
                host.append((queued - start) * 1e3)
        gc.collect()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        back_to_back = (time.perf_counter() - start) * 1e3 / steps
    finally:
        gc.enable()
    after = slow_path_counters()
    deltas = None if after is None else {name: after[name] - before[name] for name in after}
    return {"ms_per_step": summarize(times), "samples": times, "host_ms_per_step": summarize(host),
            "host_samples": host, "back_to_back_ms": back_to_back,
            "slow_path_during_timed_steps": deltas}


def bench_gpt2(torch, warmup, steps, batch, length):
    sys.path.insert(0, os.path.join(HERE, "workloads"))
    from gpt2_model import make_training, training_step

    model, optimizer = make_training(seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, length + 1), device="cuda")
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    timing = time_steps(torch, lambda: training_step(model, optimizer, idx, targets), warmup, steps)
    result = {**timing, "batch": batch, "seq_len": length, "steps": steps, **memory_peaks(torch)}
    del model, optimizer, tokens, idx, targets
    return result


def bench_gpt2_generate(torch, warmup, steps, batch, prompt_len, new_tokens):
    sys.path.insert(0, os.path.join(HERE, "workloads"))
    from gpt2_generate import greedy
    from gpt2_model import decode, gpt2

    torch.manual_seed(0)
    model = gpt2().to(device="cuda", dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
    timing = time_steps(torch, lambda: decode(model, prompt, new_tokens, greedy), warmup, steps)
    result = {**timing, "batch": batch, "seq_len": prompt_len, "new_tokens": new_tokens, "steps": steps,
              **memory_peaks(torch)}
    del model, prompt
    return result


def autocast_step(torch, optimizer, loss_fn):
    """One training step: loss_fn() under bf16 autocast, backward, update."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_hf_llama(torch, warmup, steps, batch, length):
    sys.path.insert(0, os.path.join(HERE, "workloads"))
    import _workload  # sets the offline variables before transformers loads
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = _workload.llama_config(tiny=False, tiny_positions=0)
    config.use_cache = False
    model = LlamaForCausalLM(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(0, config.vocab_size, (batch, length), device="cuda")

    step = autocast_step(torch, optimizer, lambda: model(input_ids=tokens, labels=tokens).loss)
    timing = time_steps(torch, step, warmup, steps)
    result = {**timing, "batch": batch, "seq_len": length, "steps": steps, **memory_peaks(torch)}
    del model, optimizer, tokens
    return result


def bench_resnet50(torch, warmup, steps, batch):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(batch, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (batch,), device="cuda")

    step = autocast_step(torch, optimizer, lambda: torch.nn.functional.cross_entropy(model(images), labels))
    timing = time_steps(torch, step, warmup, steps)
    result = {**timing, "batch": batch, "steps": steps, **memory_peaks(torch)}
    del model, optimizer, images, labels
    return result


def worker(mode, out_path, args):
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # before torch starts its threads, which inherit it
    torch = enter_mode(mode, "python_bench")
    streamalloc_config = sys.modules["streamalloc"].config() if mode == "streamalloc" else None
    backend = torch.cuda.get_allocator_backend()
    result = {
        "mode": mode,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "allocator_backend": backend,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "streamalloc_config": streamalloc_config,
        "cpu": args.cpu,
    }
    log(f"mode {mode}: torch {torch.__version__}, allocator backend {backend}")
    if "empty_del" in args.parts:
        result["empty_del"] = bench_empty_del(torch, args.reps, args.warmup, args.iterations)
    steps = {
        "gpt2_train_step": lambda: bench_gpt2(torch, args.step_warmup, args.steps, args.gpt2_batch, args.gpt2_seq_len),
        "resnet50_train_step": lambda: bench_resnet50(torch, args.step_warmup, args.steps, args.resnet_batch),
        "hf_llama_train_step": lambda: bench_hf_llama(torch, args.step_warmup, args.steps, args.llama_batch,
                                                      args.llama_seq_len),
        "gpt2_generate": lambda: bench_gpt2_generate(torch, args.step_warmup, args.steps, args.generate_batch,
                                                     args.generate_prompt_len, args.generate_new_tokens),
    }
    for key, name in WORKLOADS:
        if key in args.parts:
            reset_memory(torch)
            result[key] = steps[key]()
            log(f"{mode}: {name}: median {result[key]['ms_per_step']['median']:.2f} ms")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


# ---------------------------------------------------------------- driver


WORKLOADS = [("gpt2_train_step", "GPT-2 small step"), ("resnet50_train_step", "ResNet-50 step"),
             ("hf_llama_train_step", "HF Llama step"), ("gpt2_generate", "GPT-2 small generate")]
PARTS = ["empty_del", *(key for key, _ in WORKLOADS)]


class Stopped(Exception):
    """SIGTERM (what `timeout` sends) arrived while the workers ran."""


def raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def run_workers(args, passthrough):
    """Every mode once per round, round r starting at the r-th mode; returns
    each mode's rounds merged (merge_rounds) and, when the run stopped early,
    a line saying so (else None). Stopped by SIGTERM or Ctrl-C, the running
    worker is killed and the rounds every mode finished are kept, so a run
    cut short by a time limit still reports them."""
    rounds = {mode: [] for mode in args.modes}
    stopped = None
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        for r in range(args.rounds):
            order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
            for mode in order:
                log(f"round {r + 1}/{args.rounds}: running mode {mode}")
                start = time.perf_counter()
                result = run_worker(__file__, mode, passthrough, args.timeout)
                result["wall_s"] = round(time.perf_counter() - start, 1)
                rounds[mode].append(result)
    except (Stopped, KeyboardInterrupt) as e:
        stopped = str(e) if isinstance(e, Stopped) else "Ctrl-C"
    finally:
        signal.signal(signal.SIGTERM, previous)
    complete = min(len(results) for results in rounds.values())
    note = None
    if stopped is not None:
        if complete == 0:
            raise SystemExit(f"python_bench: stopped by {stopped} before every mode had run once")
        note = f"Stopped by {stopped}: the tables cover the {complete} of {args.rounds} rounds that every mode finished."
        log(note)
    return {mode: merge_rounds(mode, results[:complete]) for mode, results in rounds.items()}, note


def per_round_medians(rounds, label, other, combine):
    """Per round, the median over its repetitions of combine(`label`'s
    sample, `other`'s sample of the same repetition)."""
    return [summarize([combine(a, b) for a, b in zip(r["empty_del"][label]["samples"], r["empty_del"][other]["samples"])])
            ["median"] for r in rounds]


def merge_rounds(mode, rounds):
    """One result per mode: samples pooled over the rounds and summarized
    again, back-to-back step times and slow-path counters per round, memory
    peaks at their highest. A mode with a failed round reports the failure."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return {"mode": mode, "error": f"{len(failed)} of {len(rounds)} rounds failed: {failed[0]['error']}",
                "rounds": rounds}
    merged = {k: v for k, v in rounds[0].items() if k not in ("empty_del", *dict(WORKLOADS))}
    merged["rounds"] = len(rounds)
    merged["wall_s"] = round(sum(r["wall_s"] for r in rounds), 1)
    if "empty_del" in rounds[0]:
        merged["empty_del"] = {}
        for label in [label for label, _ in EMPTY_SIZES] + [CONTROL]:
            samples = [x for r in rounds for x in r["empty_del"][label]["samples"]]
            merged["empty_del"][label] = {**rounds[0]["empty_del"][label], "ns_per_pair": summarize(samples),
                                          "samples": samples}
        for label, _ in EMPTY_SIZES:
            if label != BASELINE:
                merged["empty_del"][label]["allocator_share_ns_per_round"] = per_round_medians(
                    rounds, label, BASELINE, lambda size, base: size - base)
            merged["empty_del"][label]["over_control_per_round"] = per_round_medians(
                rounds, label, CONTROL, lambda size, control: size / control)
    for key, _ in WORKLOADS:
        if key not in rounds[0]:
            continue
        per_round = [r[key] for r in rounds]
        samples = [x for w in per_round for x in w["samples"]]
        host_samples = [x for w in per_round for x in w["host_samples"]]
        workload = {k: v for k, v in per_round[0].items() if k not in ("peak_allocated", "peak_reserved", "error")}
        workload.update({
            "ms_per_step": summarize(samples), "samples": samples,
            "median_ms_per_round": [w["ms_per_step"]["median"] for w in per_round],
            "host_ms_per_step": summarize(host_samples), "host_samples": host_samples,
            "back_to_back_ms": summarize([w["back_to_back_ms"] for w in per_round]),
            "back_to_back_ms_per_round": [w["back_to_back_ms"] for w in per_round],
            "slow_path_during_timed_steps": [w["slow_path_during_timed_steps"] for w in per_round],
        })
        if all("peak_reserved" in w for w in per_round):
            workload["peak_allocated"] = max(w["peak_allocated"] for w in per_round)
            workload["peak_reserved"] = max(w["peak_reserved"] for w in per_round)
        else:
            workload["error"] = next(w["error"] for w in per_round if "error" in w)
        merged[key] = workload
    return merged


def fmt_ns(summary):
    if summary is None:
        return "-"
    us = [summary[k] / 1e3 for k in ("median", "p10", "p90")]
    return f"{us[0]:.2f} us [{us[1]:.2f}, {us[2]:.2f}]"


def fmt_ms(summary):
    if summary is None:
        return "-"
    return f"{summary['median']:.2f} ms [{summary['p10']:.2f}, {summary['p90']:.2f}]"


def fmt_gib(value):
    return "-" if value is None else f"{value / 2**30:.2f}"


def print_empty_del(ok, modes, compare, header):
    print()
    print("### torch.empty(n, device=\"cuda\") + del, median time per pair [p10, p90]")
    print()
    print(header("size", "streamalloc speed-up vs native"))
    for label in [label for label, _ in EMPTY_SIZES] + [CONTROL]:
        cells = [fmt_ns(ok[m]["empty_del"][label]["ns_per_pair"]) if m in ok else "failed" for m in modes]
        row = f"| {label} | " + " | ".join(cells) + " |"
        if compare:
            native = ok["native"]["empty_del"][label]["ns_per_pair"]["median"]
            ours = ok["streamalloc"]["empty_del"][label]["ns_per_pair"]["median"]
            row += f" {native / ours:.2f}x |"
        print(row)
    print()
    print(f"{CONTROL}: torch.empty(0) on the CPU, timed in the same repetitions; it runs the same code "
          "under every mode, so its row shows how fast each mode's processes ran.")
    print()
    print(f"### A size's time per pair over the {CONTROL}'s in the same repetition, median per process, "
          "median over rounds [min, max]")
    print()
    print(header("size", "streamalloc speed-up vs native"))
    print_per_round_rows(ok, modes, compare, [label for label, _ in EMPTY_SIZES], "over_control_per_round",
                         lambda v: f"{v:.2f}", lambda native, ours: f"{native / ours:.2f}x")
    print()
    print(f"### The allocator's share: a size less the {BASELINE} of the same repetition, median per process, "
          "median over rounds [min, max]")
    print()
    print(header("size", "streamalloc less native"))
    print_per_round_rows(ok, modes, compare, [label for label, _ in EMPTY_SIZES if label != BASELINE],
                         "allocator_share_ns_per_round", lambda v: f"{v:.0f}", lambda native, ours: f"{ours - native:+.0f} ns",
                         unit=" ns")


def print_per_round_rows(ok, modes, compare, labels, key, fmt, versus, unit=""):
    """One row per size of a per-round figure: median [min, max] over rounds
    for each mode, and streamalloc against native."""
    for label in labels:
        figures = {m: summarize(ok[m]["empty_del"][label][key]) for m in ok}
        cells = [f"{fmt(figures[m]['median'])}{unit} [{fmt(figures[m]['min'])}, {fmt(figures[m]['max'])}]"
                 if m in ok else "failed" for m in modes]
        row = f"| {label} | " + " | ".join(cells) + " |"
        if compare:
            row += f" {versus(figures['native']['median'], figures['streamalloc']['median'])} |"
        print(row)


def paired_round_ratios(native, ours, figure):
    """streamalloc's figure over native's of the same round, per round: the
    rounds ran every mode back to back, so the host's slow and fast spells
    fall on both sides of each ratio."""
    return [b / a for a, b in zip(native[figure], ours[figure])]


def print_paired_rounds(ok, timed):
    print()
    print("### streamalloc's step time over native's in the same round (the round's median step between "
          "synchronizations; steps back to back): median over rounds [min, max]")
    print()
    print("| workload | rounds | between synchronizations | back to back |")
    print("|---|---|---|---|")
    for key, name in timed:
        native, ours = ok["native"][key], ok["streamalloc"][key]
        cells = []
        for figure in ("median_ms_per_round", "back_to_back_ms_per_round"):
            ratios = summarize([(r - 1) * 100 for r in paired_round_ratios(native, ours, figure)])
            cells.append(f"{ratios['median']:+.2f}% [{ratios['min']:+.2f}, {ratios['max']:+.2f}]")
        print(f"| {name} | {len(native['median_ms_per_round'])} | " + " | ".join(cells) + " |")


def print_tables(results, modes):
    ok = {m: r for m, r in results.items() if "error" not in r}
    first = next(iter(ok.values()), {})
    print(f"## Python-level benchmark (bench/python_bench.py) on {first.get('device', '?')}, torch {first.get('torch', '?')}")
    print()
    rounds = first.get("rounds", 1)
    pinned = f", every process on CPU {first['cpu']}" if first.get("cpu") is not None else ""
    print(f"Each column pools {rounds} round{'s' if rounds != 1 else ''}, a process per mode and round{pinned}, the modes "
          "of a round in rotated order: " + "; ".join(
        f"{m}: " + (f"PYTORCH_CUDA_ALLOC_CONF={TORCH_MODE_CONF[m]}" if m in TORCH_MODE_CONF else
                    "streamalloc.install(), default settings" if m == "streamalloc" else "torch defaults")
        for m in modes))
    if ok.get("streamalloc", {}).get("streamalloc_config"):
        print()
        print(f"streamalloc settings in force: {ok['streamalloc']['streamalloc_config']}")
    for mode in modes:
        if "error" in results[mode]:
            print(f"- {mode}: {results[mode]['error']}")
    compare = "native" in ok and "streamalloc" in ok

    def header(first_column, comparison):
        extra = f" {comparison} |" if compare else ""
        return f"| {first_column} | " + " | ".join(modes) + " |" + extra + "\n|---|" + "---|" * (len(modes) + int(compare))

    if "empty_del" in first:
        print_empty_del(ok, modes, compare, header)
    timed = [(key, name) for key, name in WORKLOADS if key in first]
    if not timed:
        return

    def step_table(title, figure, fmt, with_detail):
        print()
        print(title)
        print()
        print(header("workload", "streamalloc step time vs native"))
        for key, name in timed:
            detail = ""
            if with_detail and key in first:
                w = first[key]
                detail = (f" (batch {w['batch']}" + (f", seq {w['seq_len']}" if "seq_len" in w else "")
                          + (f", {w['new_tokens']} new tokens" if "new_tokens" in w else "") + f", {w['steps']} steps)")
            cells = [fmt(ok[m][key][figure]) if m in ok else "failed" for m in modes]
            row = f"| {name}{detail} | " + " | ".join(cells) + " |"
            if compare:
                native = ok["native"][key][figure]["median"]
                ours = ok["streamalloc"][key][figure]["median"]
                row += f" {(ours / native - 1) * 100:+.2f}% time |"
            print(row)

    step_table("### One training step (bf16 autocast) or generation request between two synchronizations, "
               "median [p10, p90]",
               "ms_per_step", fmt_ms, True)
    step_table("### The host's share of a synchronized step: from its start until the step's Python call returns, "
               "before the synchronization waits for the device; median [p10, p90]",
               "host_ms_per_step", fmt_ms, False)
    step_table("### Steps back to back, one synchronization per run of steps: ms per step, median over rounds [min, max]",
               "back_to_back_ms", lambda b: f"{b['median']:.2f} ms [{b['min']:.2f}, {b['max']:.2f}]", False)
    if compare:
        print_paired_rounds(ok, timed)
    if "streamalloc" in ok:
        print()
        print("streamalloc's device calls and waits during the timed steps (per round, sum of the counters "
              + ", ".join(SLOW_PATH_COUNTERS) + "): " + "; ".join(
                  f"{name} " + ", ".join(str(sum(d.values())) for d in ok["streamalloc"][key]["slow_path_during_timed_steps"])
                  for key, name in timed))
    print()
    print("### Peak memory of the steps, GiB reserved / allocated")
    print()
    print("| workload | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for key, name in timed:
        cells = []
        for m in modes:
            w = ok.get(m, {}).get(key)
            if w is None:
                cells.append("failed")
            elif "error" in w:
                cells.append("not reported")
            else:
                cells.append(f"{fmt_gib(w['peak_reserved'])} / {fmt_gib(w['peak_allocated'])}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per worker process (default 240)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every mode, in rotated order (default 3)")
    parser.add_argument("--quick", action="store_true", help="few repetitions: checks the script, not the numbers")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from: " + ", ".join(PARTS))
    parser.add_argument("--cpu", type=int, help="pin every worker process to this CPU (less noise between processes)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    counts = parser.add_argument_group("counts")
    counts.add_argument("--reps", type=int, default=15, help="timed repetitions of empty+del (default 15)")
    counts.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    counts.add_argument("--iterations", type=int, default=10000, help="pairs per repetition (default 10000)")
    counts.add_argument("--steps", type=int, default=20, help="timed training steps (default 20)")
    counts.add_argument("--step-warmup", type=int, default=5, help="untimed training steps first (default 5)")
    counts.add_argument("--gpt2-batch", type=int, default=8)
    counts.add_argument("--gpt2-seq-len", type=int, default=1024)
    counts.add_argument("--resnet-batch", type=int, default=64)
    counts.add_argument("--llama-batch", type=int, default=8)
    counts.add_argument("--llama-seq-len", type=int, default=1024)
    counts.add_argument("--generate-batch", type=int, default=8)
    counts.add_argument("--generate-prompt-len", type=int, default=256)
    counts.add_argument("--generate-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.quick:
        args.reps, args.warmup, args.iterations, args.steps, args.step_warmup, args.rounds = 3, 1, 500, 3, 1, 1

    if args.worker:
        args.parts = args.parts.split(",")
        worker(args.worker, args.out, args)
        return 0

    args.modes = args.modes.split(",")
    check_choices(parser, "mode", args.modes, MODES)
    check_choices(parser, "part", args.parts.split(","), PARTS)
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu {args.cpu}: this process may run only on CPUs {sorted(os.sched_getaffinity(0))}")
    passthrough = [
        f"--reps={args.reps}", f"--warmup={args.warmup}", f"--iterations={args.iterations}",
        f"--steps={args.steps}", f"--step-warmup={args.step_warmup}", f"--gpt2-batch={args.gpt2_batch}",
        f"--gpt2-seq-len={args.gpt2_seq_len}", f"--resnet-batch={args.resnet_batch}",
        f"--llama-batch={args.llama_batch}", f"--llama-seq-len={args.llama_seq_len}",
        f"--generate-batch={args.generate_batch}", f"--generate-prompt-len={args.generate_prompt_len}",
        f"--generate-new-tokens={args.generate_new_tokens}", f"--parts={args.parts}",
    ] + ([f"--cpu={args.cpu}"] if args.cpu is not None else [])
    results, stop_note = run_workers(args, passthrough)
    if stop_note is not None:
        print(stop_note)
        print()
    print_tables(results, args.modes)
    status = finish("python_bench", args.modes, results, args.json)
    return 1 if stop_note is not None else status


if __name__ == "__main__":
    sys.exit(main())
