#!/usr/bin/env python3
"""What a user feels under a memory cap: the largest training batch that
fits, and the step time at a batch that fits, when the process is capped
with torch.cuda.set_per_process_memory_fraction, under four allocators,
every one in its own process (bench/python_bench.py's modes):

  native       torch's default caching allocator
  expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cuda_async   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  streamalloc  `import streamalloc; streamalloc.install()` before any CUDA
               allocation, default settings; the package must be
               importable (PYTHONPATH)

    python bench/memory_cap_bench.py [--workload llama|gpt2] [--cap-gib 20] \\
        [--modes native,streamalloc] [--parts ramp,time,pair] [--json FILE]

The workload is a training loop whose sequence length changes from step to
step: the HF Llama of bench/workloads/hf_llama_train.py (about 160M
parameters, lengths 64..1024) or GPT-2 small (bench/workloads/gpt2_model.py,
lengths 32..1024 as in gpt2_train_varlen.py), bf16 autocast,
AdamW, random weights. The default cap, 20 GiB, is meant to fit a Llama
batch of about 10 to 20: on the CPU the same steps peak at about 2 GiB of
weights and optimizer state plus 0.8 GiB per sequence of 1024 tokens (not
yet measured on the GPU).

Part 1, the largest batch: one process per mode ramps the batch up a grid
(--batch-step, 2x--batch-step, ... up to --max-batch) and runs --ramp-steps
steps at each batch, drawn lengths and then the longest. It reports the
largest batch whose steps all completed before the first
torch.OutOfMemoryError, the peak reserved and allocated memory of that
batch's steps, and the counters below over the whole ramp. Nothing is
freed between batches: what the smaller batches left cached or fragmented
is part of what is measured, as a user ramping a batch up in one process
would see. A ramp stops starting batches once its process has run
--time-limit seconds.

Part 2, the step time: a fresh process per mode and round runs, at one
batch (--batch, or else the largest batch every mode fitted in part 1),
--warmup steps (the longest length first) and then --steps timed steps,
each between two synchronizations, and reports the median and p90 step
time and, over the timed steps, the allocator's retries after a failed
device allocation (num_alloc_retries: the stalls a cap causes), its device
allocations and frees, and peak reserved and allocated memory. Its first
round starts at the second mode named, each later round one mode further
on, so no mode always runs first. torch reports those counters as zero
under cudaMallocAsync, which keeps none: they read n/a there.

Part 3, two processes on one GPU (`--parts pair`, not run unless asked
for): per mode, two processes of that mode train at once on one GPU,
without a cap, on what a ballast leaves free. This shows the cost of
memory a process keeps reserved but unused: a caching allocator frees its
own cache on a failed allocation (a retry), never the other process's, so
one process's cache can starve the other. Before the two start, a ballast
process (torch's native allocator, in a process of its own) reads the
device's free memory with torch.cuda.mem_get_info() and allocates all but
--pair-gib GiB (default twice --cap-gib: the two capped processes' total),
and holds it until both have ended; it is killed whatever happens. The two
processes' CUDA contexts come out of those GiB too. Each builds its model
(seed --seed and --seed + 1), waits until the other has built its own (a
barrier), and runs part 2's loop at --pair-batch (default: --batch, or
else the largest batch every mode fitted in part 1): --warmup steps, the
longest length first, then --steps timed steps, starting no step once it
has run --time-limit seconds. Each reports the steps it completed, its
first torch.OutOfMemoryError (then it stops and exits), the median and p90
of its timed steps, and, over all its steps, the counters and the peak
reserved and allocated memory, and the device's free memory when its steps
start and after its warm-up. A row per mode: whether both finished, each
one's steps, the first out-of-memory error, each one's median step time,
retries and peak reserved memory, and what the ballast left free.

Prints a markdown table per part, a row per mode, and with --json writes
every result. Exits non-zero when a process failed or overran its time;
an out-of-memory error is a result, not a failure.

With `--device cpu --tiny` the same code runs on the CPU with a tiny model,
which checks the script without a GPU: no cap applies there, part 3 has no
ballast, the modes only name the processes, and --fake-oom-batch N raises
torch.OutOfMemoryError at every batch >= N in place of a real one.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from _driver import TORCH_MODE_BACKEND, check_choices, mode_env, run_worker
from python_bench import summarize

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["native", "expandable", "cuda_async", "streamalloc"]
PARTS = ["ramp", "time", "pair"]
DEFAULT_PARTS = ["ramp", "time"]  # pair runs when asked for
PAIR_NAMES = "AB"  # part 3's two processes
# Sequence lengths (min, max) and the longest the model takes, as the
# workload scripts run them; the tiny models' for --tiny.
WORKLOADS = {
    "llama": {"lengths": (64, 1024), "tiny_lengths": (8, 32), "positions": 2048, "tiny_positions": 128},
    "gpt2": {"lengths": (32, 1024), "tiny_lengths": (8, 32), "positions": 1024, "tiny_positions": 64},
}
# torch.cuda.memory_stats counters reported over the timed steps.
COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
# A worker may overrun --time-limit by the batch in flight and its exit.
WORKER_GRACE_S = 60
# The longest part 3's ballast may take to start and allocate.
BALLAST_START_S = 120


def log(message):
    print(f"memory_cap_bench[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- worker


class session:
    """One worker's device, allocator and training step."""

    def __init__(self, mode, args):
        self.args = args
        self.started = time.perf_counter()
        self.streamalloc_config = None
        if mode == "streamalloc" and args.device == "cuda":
            # Before torch makes any CUDA allocation.
            import streamalloc

            streamalloc.install()
            if not streamalloc.is_installed():
                raise SystemExit("memory_cap_bench: streamalloc.install() returned but streamalloc is not installed")
            self.streamalloc_config = streamalloc.config()
        sys.path.insert(0, os.path.join(HERE, "workloads"))
        import _workload  # sets the offline variables before transformers loads
        import torch

        self.torch = torch
        self.run = _workload.run("memory_cap_bench", args)  # seeds, checks the device
        self.cuda = self.run.cuda
        self.backend = None
        self.cap = None
        total = None
        if self.cuda:
            total = torch.cuda.mem_get_info()[1]
            if args.part != "pair":  # part 3's processes share the device uncapped
                self.cap = int(args.cap_gib * 2**30)
                if self.cap > total:
                    raise SystemExit(f"memory_cap_bench: --cap-gib {args.cap_gib} is over the device's "
                                     f"{total / 2**30:.1f} GiB")
                torch.cuda.set_per_process_memory_fraction(self.cap / total)
            self.backend = torch.cuda.get_allocator_backend()
            expected = TORCH_MODE_BACKEND.get(mode)
            if expected is not None and self.backend != expected:
                raise SystemExit(f"memory_cap_bench: mode {mode} expects torch allocator backend '{expected}', "
                                 f"got '{self.backend}'")
        self.step = self._workload(_workload)
        self.header = {
            "mode": mode, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if self.cuda else "cpu",
            "allocator_backend": self.backend, "cap_bytes": self.cap, "device_total_bytes": total,
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "streamalloc_config": self.streamalloc_config,
        }

    def _workload(self, _workload):
        """step(batch, length): one training step of the chosen model."""
        torch, args, device = self.torch, self.args, self.run.device
        if args.workload == "llama":
            from transformers import LlamaForCausalLM

            config = _workload.llama_config(args.tiny, WORKLOADS["llama"]["tiny_positions"])
            config.use_cache = False
            model = LlamaForCausalLM(config).to(device).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

            def step(batch, length):
                tokens = torch.randint(0, config.vocab_size, (batch, length), device=device)
                with self.run.autocast():
                    loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return step
        from gpt2_model import gpt2_config, make_training, training_step

        config = None
        if args.tiny:
            config = gpt2_config(vocab_size=256, n_ctx=WORKLOADS["gpt2"]["tiny_positions"], n_embd=64, n_layer=2,
                                 n_head=4)
        model, optimizer = make_training(device, args.seed, config)

        def step(batch, length):
            tokens = torch.randint(0, model.config.vocab_size, (batch, length + 1), device=device)
            training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])

        return step

    def synchronize(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def checked_step(self, batch, length):
        if self.args.fake_oom_batch and batch >= self.args.fake_oom_batch:
            raise self.torch.OutOfMemoryError(f"fake out of memory at batch {batch} (--fake-oom-batch)")
        self.step(batch, length)

    def counters(self):
        """COUNTERS from torch.cuda.memory_stats; none on the CPU, and none
        under cudaMallocAsync, for which torch reports them as zero."""
        if not self.cuda or self.backend == "cudaMallocAsync":
            return {}
        stats = self.torch.cuda.memory_stats()
        return {name: stats[name] for name in COUNTERS if name in stats}

    def reset_peaks(self):
        """Starts peaks() afresh; where the allocator cannot, peaks()
        reports none rather than the whole process's."""
        self.peaks_reset = False
        if self.cuda:
            try:
                self.torch.cuda.reset_peak_memory_stats()
                self.peaks_reset = True
            except RuntimeError:
                pass

    def peaks(self):
        """Peak reserved/allocated bytes since reset_peaks(), None where
        not reported."""
        if self.peaks_reset:
            try:
                return {"peak_reserved": self.torch.cuda.max_memory_reserved(),
                        "peak_allocated": self.torch.cuda.max_memory_allocated()}
            except RuntimeError:
                pass
        return {"peak_reserved": None, "peak_allocated": None}

    def free(self):
        """The device's free bytes (all processes'), None on the CPU."""
        return self.torch.cuda.mem_get_info()[0] if self.cuda else None

    def lengths(self, rng, count):
        return [rng.randint(self.args.min_len, self.args.max_len) for _ in range(count)]

    def ramp(self):
        args = self.args
        rng = random.Random(args.seed)
        before = self.counters()
        batches, first_oom, stopped = [], None, "grid end"
        for batch in range(args.batch_step, args.max_batch + 1, args.batch_step):
            if time.perf_counter() - self.started > args.time_limit:
                stopped = "time limit"
                break
            # The longest last, after drawn lengths have shaped the cache.
            lengths = self.lengths(rng, args.ramp_steps - 1) + [args.max_len]
            self.reset_peaks()
            start = time.perf_counter()
            try:
                for length in lengths:
                    self.checked_step(batch, length)
                self.synchronize()
            except self.torch.OutOfMemoryError as error:
                first_oom = {"batch": batch, "length": length, "message": str(error).splitlines()[0]}
                stopped = "oom"
                break
            batches.append({"batch": batch, "lengths": lengths, "s": round(time.perf_counter() - start, 3),
                            **self.peaks()})
            log(f"batch {batch} fitted ({batches[-1]['s']:.2f} s)")
        after = self.counters()
        last = batches[-1] if batches else {"batch": 0, "peak_reserved": None, "peak_allocated": None}
        return {"largest_batch": last["batch"], "stopped": stopped, "first_oom": first_oom, "batches": batches,
                "peak_reserved": last["peak_reserved"], "peak_allocated": last["peak_allocated"],
                "counters": {k: after[k] - before[k] for k in after if k in before},
                "ramp_s": round(time.perf_counter() - self.started, 1)}

    def timed(self):
        args = self.args
        rng = random.Random(args.seed)
        lengths = [args.max_len] + self.lengths(rng, args.warmup + args.steps - 1)
        times, before = [], None
        try:
            for i, length in enumerate(lengths):
                if i == args.warmup:
                    self.synchronize()
                    self.reset_peaks()
                    before = self.counters()
                self.synchronize()
                start = time.perf_counter()
                self.checked_step(args.batch, length)
                self.synchronize()
                if i >= args.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
        except self.torch.OutOfMemoryError as error:
            return {"batch": args.batch, "oom": {"step": i, "length": length,
                                                 "message": str(error).splitlines()[0]}}
        after = self.counters()
        return {"batch": args.batch, "lengths": lengths, "samples": times, "ms_per_step": summarize(times),
                "counters": {k: after[k] - before[k] for k in after if k in before}, **self.peaks()}

    def barrier(self):
        """Part 3: says this process is ready (a file ready.INDEX in
        --barrier) and waits for the driver's file `go`, written once both
        processes are ready (or one has ended), or until --time-limit."""
        args = self.args
        open(os.path.join(args.barrier, f"ready.{args.pair_index}"), "w").close()
        start = time.perf_counter()
        go = os.path.join(args.barrier, "go")
        released = True
        while not os.path.exists(go):
            if time.perf_counter() - self.started > args.time_limit:
                released = False
                break
            time.sleep(0.005)
        return {"waited_s": round(time.perf_counter() - start, 3), "released": released}

    def paired(self):
        """Part 3, one of the two processes: after the barrier, part 2's
        loop at --pair-batch until the first out-of-memory error or
        --time-limit; counters and peaks over all its steps."""
        args = self.args
        rng = random.Random(args.seed)
        lengths = [args.max_len] + self.lengths(rng, args.warmup + args.steps - 1)
        result = {"batch": args.pair_batch, "name": PAIR_NAMES[args.pair_index], "seed": args.seed,
                  "barrier": self.barrier()}
        self.synchronize()
        self.reset_peaks()
        before = self.counters()
        result.update(free_at_start=self.free(), free_after_warmup=None)
        go = time.perf_counter()
        times, oom, stopped, completed = [], None, "done", 0
        for i, length in enumerate(lengths):
            if time.perf_counter() - self.started > args.time_limit:
                stopped = "time limit"
                break
            if i == args.warmup:
                result["free_after_warmup"] = self.free()
            start = time.perf_counter()
            try:
                self.checked_step(args.pair_batch, length)
                self.synchronize()
            except self.torch.OutOfMemoryError as error:
                oom = {"step": i, "length": length, "s": round(time.perf_counter() - go, 3),
                       "message": str(error).splitlines()[0]}
                stopped = "oom"
                break
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
            completed = i + 1
        after = self.counters()
        result.update(steps=completed, planned_steps=len(lengths), stopped=stopped, oom=oom,
                      lengths=lengths[:completed], samples=times, ms_per_step=summarize(times),
                      counters={k: after[k] - before[k] for k in after if k in before},
                      loop_s=round(time.perf_counter() - go, 3), **self.peaks())
        return result


def worker(mode, out_path, args):
    s = session(mode, args)
    if not s.cuda:
        where = "on the CPU, no cap"
    elif args.part == "pair":
        where = f"allocator backend {s.backend}, no cap, process {PAIR_NAMES[args.pair_index]} of two"
    else:
        where = f"allocator backend {s.backend}, cap {args.cap_gib:g} GiB"
    log(f"mode {mode}, part {args.part}: torch {s.header['torch']}, {where}")
    body = {"ramp": s.ramp, "time": s.timed, "pair": s.paired}[args.part]()
    result = {**s.header, **body}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def ballast(keep, out_path):
    """Part 3's ballast process: allocates, through torch's native
    allocator, all but `keep` bytes of what the device has free, writes
    what it did to out_path, and holds the memory until its stdin closes
    (or it is killed)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("memory_cap_bench: the ballast sees no CUDA device")
    free, total = torch.cuda.mem_get_info()
    size = max(0, free - keep) // 2**21 * 2**21  # the native allocator's 2 MiB rounding
    held = torch.empty(size, dtype=torch.uint8, device="cuda") if size else None
    torch.cuda.synchronize()
    left = torch.cuda.mem_get_info()[0]
    info = {"keep_bytes": keep, "free_before": free, "device_total_bytes": total, "ballast_bytes": size,
            "free_after": left, "short": free < keep, "allocator_backend": torch.cuda.get_allocator_backend()}
    with open(out_path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(out_path + ".tmp", out_path)
    log(f"ballast: {size / 2**30:.2f} GiB held, {left / 2**30:.2f} GiB of {total / 2**30:.1f} GiB left free"
        + (f" (fewer than the {keep / 2**30:.2f} GiB asked for were free)" if free < keep else ""))
    sys.stdin.read()  # until the driver closes the pipe or ends
    del held


# ---------------------------------------------------------------- driver


def run_part(part, orders, args, passthrough):
    """Runs `part` in every mode of every order (one order per round);
    returns each mode's list of round results."""
    results = {mode: [] for mode in args.modes}
    for r, order in enumerate(orders):
        for mode in order:
            log(f"{part}, round {r + 1}/{len(orders)}: running mode {mode}")
            start = time.perf_counter()
            result = run_worker(__file__, mode, ["--part", part, *passthrough], args.time_limit + WORKER_GRACE_S)
            result["wall_s"] = round(time.perf_counter() - start, 1)
            results[mode].append(result)
    return results


def start_ballast(args, tmp):
    """Starts part 3's ballast and waits until it holds its memory;
    returns (process, its report or {"error"}). The caller stops it."""
    out_path = os.path.join(tmp, "ballast.json")
    keep = int(args.pair_gib * 2**30)
    command = [sys.executable, os.path.abspath(__file__), "--ballast", str(keep), "--out", out_path]
    proc = subprocess.Popen(command, env=mode_env("native"), stdin=subprocess.PIPE, stdout=sys.stderr)
    deadline = time.perf_counter() + BALLAST_START_S
    while not os.path.exists(out_path):
        if proc.poll() is not None:
            return proc, {"error": f"ballast failed (exit status {proc.returncode})"}
        if time.perf_counter() > deadline:
            return proc, {"error": f"ballast did not start in {BALLAST_START_S} s"}
        time.sleep(0.05)
    with open(out_path) as f:
        return proc, json.load(f)


def stop(proc):
    """Ends a process we started (nothing when it has ended)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def run_pair(mode, args, passthrough):
    """Part 3 in `mode`: the ballast (on a GPU), then the two processes
    at once, their barrier released once both are ready; the ballast and
    any process still running are killed on the way out, whatever
    happened."""
    result = {"mode": mode, "ballast": None}
    start = time.perf_counter()
    held, procs = None, []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.device == "cuda":
                held, result["ballast"] = start_ballast(args, tmp)
                if "error" in result["ballast"]:
                    return {**result, "error": result["ballast"]["error"]}
            go = os.path.join(tmp, "go")
            for i, name in enumerate(PAIR_NAMES):
                out_path = os.path.join(tmp, f"{name}.json")
                command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out_path,
                           "--part", "pair", *passthrough, f"--seed={args.seed + i}", f"--pair-index={i}",
                           f"--barrier={tmp}"]
                procs.append(subprocess.Popen(command, env=mode_env(mode), stdout=sys.stderr))
            launched = time.perf_counter()
            deadline = launched + args.time_limit + WORKER_GRACE_S
            ended = [None] * len(procs)
            while None in ended and time.perf_counter() < deadline:
                for i, proc in enumerate(procs):
                    if ended[i] is None and proc.poll() is not None:
                        ended[i] = time.perf_counter()
                if not os.path.exists(go) and all(
                        ended[i] is not None or os.path.exists(os.path.join(tmp, f"ready.{i}"))
                        for i in range(len(procs))):
                    open(go, "w").close()
                    log(f"pair, mode {mode}: both processes ready, go")
                time.sleep(0.01)
            workers = []
            for i, (name, proc) in enumerate(zip(PAIR_NAMES, procs)):
                out_path = os.path.join(tmp, f"{name}.json")
                if ended[i] is None:
                    stop(proc)
                    r = {"error": f"worker timed out after {args.time_limit + WORKER_GRACE_S:.0f} s"}
                elif proc.returncode == 0 and os.path.exists(out_path):
                    with open(out_path) as f:
                        r = json.load(f)
                else:
                    r = {"error": f"worker failed (exit status {proc.returncode})"}
                r.update(name=name, wall_s=round((ended[i] or time.perf_counter()) - launched, 1))
                workers.append(r)
            result["workers"] = workers
        finally:
            for proc in procs:
                stop(proc)
            if held is not None:
                stop(held)
                log(f"pair, mode {mode}: ballast released")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def merge_rounds(mode, rounds):
    """One part-2 result per mode: samples pooled, counters summed, peaks at
    their highest; a failed round or an out-of-memory one stands for all."""
    for r in rounds:
        if "error" in r or "oom" in r:
            return {**r, "rounds": len(rounds)}
    samples = [x for r in rounds for x in r["samples"]]
    merged = {k: v for k, v in rounds[0].items() if k not in ("samples", "counters", "wall_s")}
    merged.update(rounds=len(rounds), samples=samples, ms_per_step=summarize(samples),
                  wall_s=round(sum(r["wall_s"] for r in rounds), 1),
                  counters={k: sum(r["counters"][k] for r in rounds)
                            for k in rounds[0]["counters"] if all(k in r["counters"] for r in rounds)})
    for key in ("peak_reserved", "peak_allocated"):
        values = [r[key] for r in rounds]
        merged[key] = None if None in values else max(values)
    return merged


def fmt_gib(value):
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def fmt_count(counters, name):
    return str(counters[name]) if name in counters else "n/a"


def under(args):
    return f"under a {args.cap_gib:g} GiB cap" if args.device == "cuda" else "on the CPU, no cap"


def print_table(title, columns, results, args, cells_of):
    """A markdown table, a row per mode: `columns` after "mode", the cells
    `cells_of(result)` gives, or the failure of a mode that did not run."""
    print(title)
    print()
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode in args.modes:
        r = results[mode]
        cells = [f"failed: {r['error']}"] + [""] * (len(columns) - 1) if "error" in r else cells_of(r)
        print(f"| {mode} | " + " | ".join(cells) + " |")


def print_ramp(results, args):
    def cells(r):
        largest = str(r["largest_batch"])
        if r["stopped"] != "oom":
            largest = f">= {largest} ({r['stopped']})"
        oom = r["first_oom"]
        c = r["counters"]
        return [largest, f"batch {oom['batch']}, length {oom['length']}" if oom else "-",
                fmt_gib(r["peak_reserved"]), fmt_gib(r["peak_allocated"]), fmt_count(c, "num_alloc_retries"),
                fmt_count(c, "num_device_alloc"), fmt_count(c, "num_device_free"), str(r["wall_s"])]

    print_table(f"### Largest batch {under(args)} ({args.workload}, grid {args.batch_step}.."
                f"{args.max_batch} step {args.batch_step}, {args.ramp_steps} steps a batch, lengths "
                f"{args.min_len}..{args.max_len}, the longest last)",
                ["largest batch", "first OOM", "peak reserved GiB", "peak allocated GiB", "alloc retries",
                 "device allocs", "device frees", "process s"], results, args, cells)


def print_time(results, args):
    def cells(r):
        if "oom" in r:
            return [f"out of memory at step {r['oom']['step']} (length {r['oom']['length']})"] + [""] * 6
        c = r["counters"]
        ms = r["ms_per_step"]
        return [f"{ms['median']:.2f}", f"{ms['p90']:.2f}", fmt_count(c, "num_alloc_retries"),
                fmt_count(c, "num_device_alloc"), fmt_count(c, "num_device_free"), fmt_gib(r["peak_reserved"]),
                fmt_gib(r["peak_allocated"])]

    print_table(f"### Step time at batch {args.batch} {under(args)} ({args.workload}, {args.warmup} "
                f"warm-up then {args.steps} timed steps, lengths {args.min_len}..{args.max_len}, {args.rounds} "
                f"round{'s' if args.rounds != 1 else ''}; counters and peaks over the timed steps)",
                ["median ms", "p90 ms", "alloc retries", "device allocs", "device frees", "peak reserved GiB",
                 "peak allocated GiB"], results, args, cells)


def pair_cells(w):
    """One part-3 process's cells: stopped, steps, median ms, retries,
    peak reserved GiB."""
    if "error" in w:
        return [f"failed: {w['error']}", "n/a", "n/a", "n/a", "n/a"]
    ms = w["ms_per_step"]
    return [w["stopped"], f"{w['steps']}", "n/a" if ms is None else f"{ms['median']:.2f}",
            fmt_count(w["counters"], "num_alloc_retries"), fmt_gib(w["peak_reserved"])]


def print_pair(results, args):
    def cells(r):
        a, b = (pair_cells(w) for w in r["workers"])
        ooms = [w for w in r["workers"] if w.get("oom")]
        first = min(ooms, key=lambda w: w["oom"]["s"], default=None)
        return ["yes" if a[0] == b[0] == "done" else f"no (A {a[0]}, B {b[0]})", f"{a[1]} / {b[1]}",
                f"{first['name']}, step {first['oom']['step']} (length {first['oom']['length']})" if first else "-",
                f"{a[2]} / {b[2]}", f"{a[3]} / {b[3]}", f"{a[4]} / {b[4]}",
                fmt_gib(r["ballast"]["free_after"]) if r["ballast"] else "n/a", str(r["wall_s"])]

    where = (f"on what a ballast left of the GPU (--pair-gib {args.pair_gib:g}), no cap" if args.device == "cuda"
             else "on the CPU, no ballast")
    print_table(f"### Two processes of a mode at once, batch {args.pair_batch} each, {where} ({args.workload}, "
                f"{args.warmup} warm-up then {args.steps} timed steps each, lengths {args.min_len}..{args.max_len}; "
                f"A / B: each process's, counters and peaks over all its steps)",
                ["both finished", "steps A / B", "first OOM", "median ms A / B", "alloc retries A / B",
                 "peak reserved GiB A / B", "free at start GiB", "process s"], results, args, cells)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama", help="model trained (default llama)")
    parser.add_argument("--cap-gib", type=float, default=20.0,
                        help="memory cap in GiB, through set_per_process_memory_fraction (default 20)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help="comma-separated, from: ramp (part 1), time (part 2), pair (part 3) "
                             f"(default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--time-limit", type=float, default=120,
                        help=f"seconds per process: a ramp starts no batch after them, nor a part-3 process "
                             f"a step, and a process still running {WORKER_GRACE_S} s later is stopped "
                             f"(default 120)")
    parser.add_argument("--seed", type=int, default=0)
    ramp = parser.add_argument_group("part 1, the largest batch")
    ramp.add_argument("--batch-step", type=int, default=1, help="the grid's step and first batch (default 1)")
    ramp.add_argument("--max-batch", type=int, default=64, help="the grid's last batch (default 64)")
    ramp.add_argument("--ramp-steps", type=int, default=4, help="steps at each batch (default 4)")
    timed = parser.add_argument_group("part 2, the step time")
    timed.add_argument("--batch", type=int, help="batch (default: the largest batch every mode fitted in part 1)")
    timed.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    timed.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    timed.add_argument("--rounds", type=int, default=1, help="processes per mode, in rotated order (default 1)")
    pair = parser.add_argument_group("part 3, two processes on one GPU")
    pair.add_argument("--pair-gib", type=float,
                      help="GiB a ballast leaves free for the two processes (default 2 x --cap-gib)")
    pair.add_argument("--pair-batch", type=int, help="each process's batch (default: part 2's batch rule)")
    lengths = parser.add_argument_group("sequence lengths (defaults: the workload script's)")
    lengths.add_argument("--min-len", type=int)
    lengths.add_argument("--max-len", type=int)
    smoke = parser.add_argument_group("a smoke run without a GPU")
    smoke.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    smoke.add_argument("--tiny", action="store_true", help="a tiny model and short lengths")
    smoke.add_argument("--fake-oom-batch", type=int,
                       help="with --device cpu: raise torch.OutOfMemoryError at every batch >= N (tests only)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--pair-index", type=int, choices=range(len(PAIR_NAMES)), help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--ballast", type=int, metavar="KEEP_BYTES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ballast is not None:
        return args

    workload = WORKLOADS[args.workload]
    default_min, default_max = workload["tiny_lengths" if args.tiny else "lengths"]
    args.min_len = default_min if args.min_len is None else args.min_len
    args.max_len = default_max if args.max_len is None else args.max_len
    if args.worker:
        return args

    args.modes = args.modes.split(",")
    args.parts = args.parts.split(",")
    for name, values, known in (("mode", args.modes, MODES), ("part", args.parts, PARTS)):
        check_choices(parser, name, values, known)
        if len(set(values)) != len(values):
            parser.error(f"--{name}s names a {name} twice")
    positions = workload["tiny_positions" if args.tiny else "positions"]
    checks = [
        (args.cap_gib > 0, "--cap-gib must be positive"),
        (args.time_limit > 0, "--time-limit must be positive"),
        (args.batch_step >= 1, "--batch-step must be at least 1"),
        (args.max_batch >= args.batch_step, "--max-batch must be at least --batch-step"),
        (args.ramp_steps >= 1, "--ramp-steps must be at least 1"),
        (args.batch is None or args.batch >= 1, "--batch must be at least 1"),
        (args.warmup >= 0, "--warmup must not be negative"),
        (args.steps >= 1, "--steps must be at least 1"),
        (args.rounds >= 1, "--rounds must be at least 1"),
        (1 <= args.min_len <= args.max_len, "--min-len must be at least 1 and at most --max-len"),
        (args.max_len <= positions, f"--max-len must be at most {positions}, the model's positions"),
        (args.fake_oom_batch is None or args.device == "cpu", "--fake-oom-batch needs --device cpu"),
        (args.fake_oom_batch is None or args.fake_oom_batch >= 1, "--fake-oom-batch must be at least 1"),
        (args.batch is not None or "ramp" in args.parts or "time" not in args.parts,
         "--parts time without ramp needs --batch"),
        (args.pair_gib is None or args.pair_gib > 0, "--pair-gib must be positive"),
        (args.pair_batch is None or args.pair_batch >= 1, "--pair-batch must be at least 1"),
        (args.pair_batch is not None or args.batch is not None or "ramp" in args.parts or "pair" not in args.parts,
         "--parts pair without ramp needs --pair-batch (or --batch)"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    if args.pair_gib is None:
        args.pair_gib = 2 * args.cap_gib
    return args


def main():
    args = parse_args()
    if args.ballast is not None:
        ballast(args.ballast, args.out)
        return 0
    if args.worker:
        worker(args.worker, args.out, args)
        return 0

    passthrough = [f"--workload={args.workload}", f"--cap-gib={args.cap_gib}", f"--time-limit={args.time_limit}",
                   f"--seed={args.seed}", f"--batch-step={args.batch_step}", f"--max-batch={args.max_batch}",
                   f"--ramp-steps={args.ramp_steps}", f"--warmup={args.warmup}", f"--steps={args.steps}",
                   f"--min-len={args.min_len}", f"--max-len={args.max_len}", f"--device={args.device}"]
    if args.tiny:
        passthrough.append("--tiny")
    if args.fake_oom_batch:
        passthrough.append(f"--fake-oom-batch={args.fake_oom_batch}")
    report = {"tool": "memory_cap_bench", "args": {k: v for k, v in vars(args).items()
                                                   if k not in ("worker", "out", "part", "pair_index", "barrier",
                                                                "ballast")}}
    failed = False
    if "ramp" in args.parts:
        ramp = {mode: rounds[0] for mode, rounds in run_part("ramp", [args.modes], args, passthrough).items()}
        report["ramp"] = ramp
        print_ramp(ramp, args)
        fitted = [r["largest_batch"] for r in ramp.values() if "error" not in r]
        failed = len(fitted) < len(ramp)
        if args.batch is None:
            args.batch = min(fitted, default=0)
    if "time" in args.parts:
        if "ramp" in args.parts:
            print()
        if args.batch < 1:
            print("### Step time: not run, no batch fitted in every mode of part 1")
        else:
            n = len(args.modes)
            # Round r starts at mode r + 1: after part 1, no mode runs first again.
            orders = [args.modes[(r + 1) % n:] + args.modes[:(r + 1) % n] for r in range(args.rounds)]
            rounds = run_part("time", orders, args, [*passthrough, f"--batch={args.batch}"])
            timed = {mode: merge_rounds(mode, results) for mode, results in rounds.items()}
            report["time"] = timed
            report["batch"] = args.batch
            print_time(timed, args)
            failed = failed or any("error" in r for r in timed.values())
    if "pair" in args.parts:
        if "ramp" in args.parts or "time" in args.parts:
            print()
        args.pair_batch = args.batch if args.pair_batch is None else args.pair_batch
        if args.pair_batch < 1:
            print("### Two processes at once: not run, no batch fitted in every mode of part 1")
        else:
            pair = {}
            for mode in args.modes:
                log(f"pair: running mode {mode}, two processes")
                pair[mode] = run_pair(mode, args, [*passthrough, f"--pair-batch={args.pair_batch}"])
            report["pair"] = pair
            report["pair_batch"] = args.pair_batch
            print_pair(pair, args)
            failed = failed or any("error" in r or any("error" in w for w in r["workers"]) for r in pair.values())
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
