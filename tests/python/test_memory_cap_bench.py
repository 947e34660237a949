"""bench/memory_cap_bench.py on any machine: its argument errors (no torch
needed), and, where torch imports, its CPU smoke path (`--device cpu
--tiny`, with --fake-oom-batch standing in for the cap): the ramp's largest
batch, part 2 at the batch every mode fitted, a table row per mode and the
modes' rotated order, and part 3's two processes at once (no ballast on the
CPU; its failure path where no GPU is seen). Without torch (or
transformers, for the Llama run) those runs skip with the reason."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "memory_cap_bench.py"
MODES = ["native", "expandable", "cuda_async", "streamalloc"]


def _needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (not importable here)")


def bench(*args, tmp_path=None, status=0):
    """Runs the benchmark on the CPU with a tiny model (a later --device
    overrides it); returns the process and, with tmp_path, the JSON it
    wrote."""
    command = [sys.executable, str(BENCH), "--device", "cpu", "--tiny", *args]
    if tmp_path is not None:
        command += ["--json", str(tmp_path / "out.json")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == status, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads((tmp_path / "out.json").read_text()) if tmp_path is not None else None


def rows(stdout):
    """{first cell: cells} of every markdown table row but the headers."""
    table = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "mode":
            table.setdefault(cells[0], []).append(cells[1:])
    return table


@_needs("torch")
@pytest.mark.parametrize("step,oom_at,largest", [(1, 4, 3), (2, 5, 4)])
def test_ramp_reports_the_last_batch_before_the_first_oom(tmp_path, step, oom_at, largest):
    proc, out = bench("--workload", "gpt2", "--parts", "ramp", "--modes", "native", "--batch-step", str(step),
                      "--fake-oom-batch", str(oom_at), tmp_path=tmp_path)
    ramp = out["ramp"]["native"]
    assert ramp["largest_batch"] == largest
    assert ramp["stopped"] == "oom"
    assert ramp["first_oom"]["batch"] == largest + step
    assert [b["batch"] for b in ramp["batches"]] == list(range(step, largest + 1, step))
    # The longest length closes every batch.
    assert all(b["lengths"][-1] == 32 for b in ramp["batches"])
    row = rows(proc.stdout)["native"][0]
    assert row[0] == str(largest) and row[1].startswith(f"batch {largest + step}, length ")
    assert "time" not in out


@_needs("torch")
def test_ramp_without_oom_says_where_it_stopped(tmp_path):
    _, out = bench("--workload", "gpt2", "--parts", "ramp", "--modes", "native", "--max-batch", "2",
                   tmp_path=tmp_path)
    assert out["ramp"]["native"]["largest_batch"] == 2
    assert out["ramp"]["native"]["stopped"] == "grid end"


@_needs("torch")
def test_part_two_runs_at_the_largest_batch_every_mode_fitted(tmp_path):
    proc, out = bench("--workload", "gpt2", "--modes", "native,streamalloc", "--fake-oom-batch", "3",
                      "--warmup", "1", "--steps", "2", "--rounds", "2", tmp_path=tmp_path)
    assert out["batch"] == 2
    assert "### Step time at batch 2 on the CPU" in proc.stdout
    for mode in ("native", "streamalloc"):
        assert out["ramp"][mode]["largest_batch"] == 2
        timed = out["time"][mode]
        assert timed["batch"] == 2 and timed["rounds"] == 2 and len(timed["samples"]) == 4
    table = rows(proc.stdout)
    assert [len(table[m]) for m in ("native", "streamalloc")] == [2, 2]  # a row in each part
    # Part 1 in the given order, then each round of part 2 one mode further on.
    started = re.findall(r"(ramp|time), round (\d)/\d: running mode (\w+)", proc.stderr)
    assert started == [("ramp", "1", "native"), ("ramp", "1", "streamalloc"), ("time", "1", "streamalloc"),
                       ("time", "1", "native"), ("time", "2", "native"), ("time", "2", "streamalloc")]


@_needs("torch")
def test_timed_run_prints_a_row_for_every_mode(tmp_path):
    proc, out = bench("--workload", "gpt2", "--parts", "time", "--batch", "2", "--warmup", "1", "--steps", "3",
                      tmp_path=tmp_path)
    assert "### Step time at batch 2 on the CPU" in proc.stdout
    table = rows(proc.stdout)
    for mode in MODES:
        (row,) = table[mode]
        assert re.fullmatch(r"\d+\.\d\d", row[0]) and re.fullmatch(r"\d+\.\d\d", row[1]), row
        # No allocator counters or peaks on the CPU.
        assert row[2:] == ["n/a"] * 5, row
        assert len(out["time"][mode]["samples"]) == 3
    assert "ramp" not in out


@_needs("torch", "transformers")
def test_llama_ramp_runs_tiny(tmp_path):
    _, out = bench("--parts", "ramp", "--modes", "native", "--fake-oom-batch", "2", tmp_path=tmp_path)
    assert out["args"]["workload"] == "llama"
    assert out["ramp"]["native"]["largest_batch"] == 1


@pytest.mark.parametrize("args,message", [
    (["--modes", "native,tcmalloc"], "unknown mode(s) tcmalloc; known: native, expandable, cuda_async, streamalloc"),
    (["--modes", "native,native"], "--modes names a mode twice"),
    (["--parts", "warm"], "unknown part(s) warm; known: ramp, time, pair"),
    (["--parts", "time"], "--parts time without ramp needs --batch"),
    (["--parts", "time,pair", "--pair-batch", "2"], "--parts time without ramp needs --batch"),
    (["--parts", "pair"], "--parts pair without ramp needs --pair-batch (or --batch)"),
    (["--parts", "pair,pair", "--pair-batch", "2"], "--parts names a part twice"),
    (["--parts", "pair", "--pair-batch", "0"], "--pair-batch must be at least 1"),
    (["--parts", "pair", "--pair-batch", "2", "--pair-gib", "0"], "--pair-gib must be positive"),
    (["--cap-gib", "0"], "--cap-gib must be positive"),
    (["--batch-step", "0"], "--batch-step must be at least 1"),
    (["--batch-step", "4", "--max-batch", "2"], "--max-batch must be at least --batch-step"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--min-len", "40"], "--min-len must be at least 1 and at most --max-len"),
    (["--max-len", "4096"], "--max-len must be at most 128, the model's positions"),
    (["--device", "cuda", "--fake-oom-batch", "3"], "--fake-oom-batch needs --device cpu"),
    (["--workload", "bert"], "argument --workload: invalid choice: 'bert'"),
])
def test_argument_errors_are_one_clear_line(args, message):
    # --device cpu --tiny first: a later --device overrides it.
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"error: {message}" in proc.stderr.strip().splitlines()[-1], proc.stderr


def pair_row(stdout, mode):
    """Part 3's row of `mode` (its table comes last): {column: cell}."""
    header = next(line for line in stdout.splitlines() if line.startswith("| mode | both finished"))
    columns = [c.strip() for c in header.strip().strip("|").split("|")][1:]
    return dict(zip(columns, rows(stdout)[mode][-1]))


@_needs("torch")
def test_pair_runs_two_processes_of_each_mode_at_once(tmp_path):
    proc, out = bench("--workload", "gpt2", "--parts", "pair", "--modes", "native,streamalloc", "--pair-batch", "2",
                      "--warmup", "1", "--steps", "2", tmp_path=tmp_path)
    assert "### Two processes of a mode at once, batch 2 each, on the CPU, no ballast" in proc.stdout
    assert out["pair_batch"] == 2 and "ramp" not in out and "time" not in out
    for mode in ("native", "streamalloc"):
        row = pair_row(proc.stdout, mode)
        assert row["both finished"] == "yes" and row["steps A / B"] == "3 / 3" and row["first OOM"] == "-", row
        assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d", row["median ms A / B"]), row
        # No allocator counters, peaks or ballast on the CPU.
        assert row["alloc retries A / B"] == row["peak reserved GiB A / B"] == "n/a / n/a", row
        assert row["free at start GiB"] == "n/a", row
        pair = out["pair"][mode]
        assert pair["ballast"] is None
        a, b = pair["workers"]
        assert (a["name"], a["seed"], b["name"], b["seed"]) == ("A", 0, "B", 1)
        for w in (a, b):
            assert w["mode"] == mode and w["batch"] == 2 and w["cap_bytes"] is None
            assert w["stopped"] == "done" and w["oom"] is None
            assert w["steps"] == w["planned_steps"] == 3 and len(w["samples"]) == 2
            assert w["lengths"][0] == 32  # the longest first, as in part 2
            assert w["barrier"]["released"] is True
            for key in ("ms_per_step", "counters", "peak_reserved", "peak_allocated", "free_at_start",
                        "free_after_warmup", "wall_s"):
                assert key in w, key
        assert a["lengths"] != b["lengths"]  # each process its own seed
    started = re.findall(r"pair: running mode (\w+)", proc.stderr)
    assert started == ["native", "streamalloc"]
    assert len(re.findall(r"both processes ready, go", proc.stderr)) == 2


@_needs("torch")
def test_pair_reports_the_first_oom_and_is_no_failure(tmp_path):
    # Part 1 fits batch 2 (3 is out of memory); part 3 at --pair-batch 3 is out of memory at its first step.
    proc, out = bench("--workload", "gpt2", "--parts", "ramp,pair", "--modes", "native", "--max-batch", "3",
                      "--fake-oom-batch", "3", "--pair-batch", "3", "--warmup", "1", "--steps", "1",
                      tmp_path=tmp_path)
    assert out["ramp"]["native"]["largest_batch"] == 2
    row = pair_row(proc.stdout, "native")
    assert row["both finished"] == "no (A oom, B oom)" and row["steps A / B"] == "0 / 0", row
    assert re.fullmatch(r"[AB], step 0 \(length 32\)", row["first OOM"]), row
    assert row["median ms A / B"] == "n/a / n/a", row
    for w in out["pair"]["native"]["workers"]:
        assert w["oom"]["step"] == 0 and "fake out of memory at batch 3" in w["oom"]["message"]
        assert w["samples"] == [] and w["ms_per_step"] is None


@_needs("torch")
def test_pair_defaults_to_the_batch_every_mode_fitted(tmp_path):
    proc, out = bench("--workload", "gpt2", "--parts", "ramp,pair", "--modes", "native", "--fake-oom-batch", "2",
                      "--warmup", "0", "--steps", "1", tmp_path=tmp_path)
    assert out["pair_batch"] == 1
    assert pair_row(proc.stdout, "native")["steps A / B"] == "1 / 1"


@_needs("torch")
def test_pair_stops_starting_steps_at_the_time_limit(tmp_path):
    proc, out = bench("--workload", "gpt2", "--parts", "pair", "--modes", "native", "--pair-batch", "1",
                      "--time-limit", "0.001", tmp_path=tmp_path)
    row = pair_row(proc.stdout, "native")
    assert row["both finished"] == "no (A time limit, B time limit)" and row["steps A / B"] == "0 / 0", row
    assert all(w["stopped"] == "time limit" for w in out["pair"]["native"]["workers"])


@_needs("torch")
def test_pair_without_a_gpu_fails_at_the_ballast(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: this checks the ballast's failure without one")
    proc, out = bench("--workload", "gpt2", "--parts", "pair", "--modes", "native", "--pair-batch", "1",
                      "--device", "cuda", tmp_path=tmp_path, status=1)
    assert rows(proc.stdout)["native"][0][0] == "failed: ballast failed (exit status 1)"
    assert out["pair"]["native"]["error"] == "ballast failed (exit status 1)"
    assert "the ballast sees no CUDA device" in proc.stderr
