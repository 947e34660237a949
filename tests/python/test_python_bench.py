"""bench/python_bench.py on any machine: how it pools rounds, takes the
allocator's share of torch.empty+del within each repetition (a worker's
timing loop on a stand-in torch whose host slows down mid-run), sets sizes
against the CPU control, keeps the host's share of a synchronized step
apart (a stand-in torch on a fake clock), prints only the parts it ran,
rejects unknown parts, and keeps the finished rounds of a run stopped by
SIGTERM. The workers themselves need a GPU and run in scripts/gpu-bench.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import bench_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "python_bench.py"


@pytest.fixture(scope="module")
def python_bench():
    with bench_module("python_bench") as module:
        yield module


def empty_del_round(bench, base_ns, extra_ns, drift_ns=(0, 0, 0)):
    """One worker's empty_del result over three repetitions: a size's sample
    in repetition i is base_ns + drift_ns[i] plus that size's extra_ns (0 for
    the 0 B row); the CPU control is base_ns + drift_ns[i]."""
    result = {}
    for label, _ in bench.EMPTY_SIZES:
        samples = [base_ns + drift + extra_ns.get(label, 0) for drift in drift_ns]
        result[label] = {"ns_per_pair": bench.summarize(samples), "samples": samples, "iterations": 10, "reps": 3}
    control = [base_ns + drift for drift in drift_ns]
    result[bench.CONTROL] = {"ns_per_pair": bench.summarize(control), "samples": control, "iterations": 10, "reps": 3}
    return result


def worker_result(bench, mode, base_ns, extra_ns, drift_ns=(0, 0, 0)):
    return {"mode": mode, "torch": "t", "device": "d", "cpu": 3, "wall_s": 1.0,
            "empty_del": empty_del_round(bench, base_ns, extra_ns, drift_ns)}


def test_the_allocator_share_is_taken_within_each_process(python_bench):
    # Two processes of one mode whose Python speed differs by 1000 ns, the
    # second drifting during its repetitions: the pooled medians move with
    # both, the shares (taken within each repetition) with neither.
    extra = {"256 B": 50, "64 KiB": 60, "4 MiB": 70, "64 MiB": 80}
    rounds = [worker_result(python_bench, "native", 2000, extra),
              worker_result(python_bench, "native", 3000, extra, drift_ns=(0, 0, 900))]
    merged = python_bench.merge_rounds("native", rounds)
    assert merged["rounds"] == 2
    for label, share in extra.items():
        assert merged["empty_del"][label]["allocator_share_ns_per_round"] == [share, share]
    assert "allocator_share_ns_per_round" not in merged["empty_del"][python_bench.BASELINE]
    assert merged["empty_del"]["256 B"]["ns_per_pair"]["min"] == 2050
    assert merged["empty_del"]["256 B"]["ns_per_pair"]["max"] == 3950
    assert merged["empty_del"][python_bench.CONTROL]["ns_per_pair"]["max"] == 3900


def test_tables_cover_only_the_parts_that_ran(python_bench, capsys):
    native = python_bench.merge_rounds("native", [worker_result(python_bench, "native", 2000, {"4 MiB": 100})])
    ours = python_bench.merge_rounds("streamalloc", [worker_result(python_bench, "streamalloc", 2600, {"4 MiB": 40})])
    python_bench.print_tables({"native": native, "streamalloc": ours}, ["native", "streamalloc"])
    out = capsys.readouterr().out
    assert "every process on CPU 3" in out
    assert "| 4 MiB | 100 ns [100, 100] | 40 ns [40, 40] | -60 ns |" in out
    assert "| 0 B | 2.00 us [2.00, 2.00] | 2.60 us [2.60, 2.60] | 0.77x |" in out
    assert "| CPU control | 2.00 us [2.00, 2.00] | 2.60 us [2.60, 2.60] | 0.77x |" in out
    # Over the control, the slower process's 4 MiB is the faster one.
    assert "| 4 MiB | 1.05 [1.05, 1.05] | 1.02 [1.02, 1.02] | 1.03x |" in out
    assert "training step" not in out and "Peak memory" not in out


def test_unknown_parts_are_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--parts", "empty_del,warp_drive"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "unknown part(s) warp_drive" in run.stderr


class _DriftingTorch:
    """A stand-in for torch whose empty() advances a fake clock: each call
    costs a base time plus its size's extra, and the host turns 1000 ns
    slower per call halfway through the run."""

    def __init__(self, extra_by_numel, slow_after_calls):
        self.clock_ns = 0
        self.calls = 0
        self.extra_by_numel = extra_by_numel
        self.slow_after_calls = slow_after_calls
        self.cuda = self

    def empty(self, numel, device):
        self.calls += 1
        slow = 1000 if self.calls > self.slow_after_calls else 0
        self.clock_ns += 2000 + slow + (self.extra_by_numel[numel] if device == "cuda" else 0)
        return object()

    def synchronize(self):
        pass


def test_the_share_holds_while_the_host_slows_down_mid_process(python_bench, monkeypatch):
    extra = {numel: 10 * i for i, (_, numel) in enumerate(python_bench.EMPTY_SIZES)}
    reps, warmup, iterations = 9, 1, 10
    calls = (reps + warmup) * (len(python_bench.EMPTY_SIZES) + 1) * iterations
    torch = _DriftingTorch(extra, slow_after_calls=calls // 2)
    monkeypatch.setattr(python_bench.time, "perf_counter_ns", lambda: torch.clock_ns)
    result = python_bench.bench_empty_del(torch, reps, warmup, iterations)
    merged = python_bench.merge_rounds("native", [{"wall_s": 1.0, "empty_del": result}])
    for label, numel in python_bench.EMPTY_SIZES[1:]:
        assert merged["empty_del"][label]["allocator_share_ns_per_round"] == [extra[numel]]
    assert result[python_bench.CONTROL]["ns_per_pair"]["min"] == 2000
    assert result[python_bench.CONTROL]["ns_per_pair"]["max"] == 3000


def step_round(bench, mode, ms, counters):
    """One worker's HF Llama step result: every synchronized step took `ms`."""
    step = {"ms_per_step": bench.summarize([ms, ms]), "samples": [ms, ms], "host_ms_per_step": bench.summarize([1.0, 1.0]),
            "host_samples": [1.0, 1.0], "back_to_back_ms": ms,
            "slow_path_during_timed_steps": counters, "batch": 8, "seq_len": 1024, "steps": 2,
            "peak_allocated": 3 << 30, "peak_reserved": 4 << 30}
    return {"mode": mode, "torch": "t", "device": "d", "cpu": None, "wall_s": 1.0, "hf_llama_train_step": step}


def test_the_hf_llama_step_is_a_part_with_its_own_rows(python_bench, capsys):
    assert "hf_llama_train_step" in python_bench.PARTS
    native = python_bench.merge_rounds("native", [step_round(python_bench, "native", 100.0, None)])
    ours = python_bench.merge_rounds("streamalloc", [step_round(python_bench, "streamalloc", 99.0, {"num_device_alloc": 3})])
    python_bench.print_tables({"native": native, "streamalloc": ours}, ["native", "streamalloc"])
    out = capsys.readouterr().out
    assert "| HF Llama step (batch 8, seq 1024, 2 steps) | 100.00 ms" in out
    assert "| -1.00% time |" in out
    assert "HF Llama step 3" in out
    assert "| HF Llama step | 4.00 / 3.00 | 4.00 / 3.00 |" in out


def test_each_round_sets_streamalloc_against_native_of_the_same_round(python_bench, capsys):
    # The second round ran on a host 10% slower for both modes: pooled, the
    # rounds blur together; paired, each round says +1% and -2%.
    native = python_bench.merge_rounds("native", [step_round(python_bench, "native", 100.0, None),
                                                  step_round(python_bench, "native", 110.0, None)])
    ours = python_bench.merge_rounds("streamalloc", [step_round(python_bench, "streamalloc", 101.0, {}),
                                                     step_round(python_bench, "streamalloc", 107.8, {})])
    assert native["hf_llama_train_step"]["median_ms_per_round"] == [100.0, 110.0]
    python_bench.print_tables({"native": native, "streamalloc": ours}, ["native", "streamalloc"])
    out = capsys.readouterr().out
    assert "| HF Llama step | 2 | -0.50% [-2.00, +1.00] | -0.50% [-2.00, +1.00] |" in out


class _QueueingTorch:
    """A stand-in for torch on a fake clock: a step queues its work in 2 ms
    of host time, and a synchronization then waits 8 ms for the device."""

    def __init__(self):
        self.clock = 0.0
        self.queued = False
        self.cuda = types.SimpleNamespace(synchronize=self._synchronize)

    def _synchronize(self):
        if self.queued:
            self.clock += 0.008
        self.queued = False

    def step(self):
        self.clock += 0.002
        self.queued = True


def test_a_synchronized_step_keeps_the_host_share_apart(python_bench, monkeypatch):
    torch = _QueueingTorch()
    monkeypatch.setattr(python_bench.time, "perf_counter", lambda: torch.clock)
    monkeypatch.setattr(python_bench, "slow_path_counters", lambda: None)
    timing = python_bench.time_steps(torch, torch.step, warmup=1, steps=3)
    assert timing["samples"] == pytest.approx([10.0] * 3)
    assert timing["host_samples"] == pytest.approx([2.0] * 3)
    assert timing["host_ms_per_step"]["median"] == pytest.approx(2.0)
    # Back to back the host queues every step before the one wait.
    assert timing["back_to_back_ms"] == pytest.approx((3 * 2.0 + 8.0) / 3)
    merged = python_bench.merge_rounds("native", [{"wall_s": 1.0, "hf_llama_train_step": {
        **timing, "batch": 8, "seq_len": 1024, "steps": 3, "peak_allocated": 1, "peak_reserved": 1}}])
    assert merged["hf_llama_train_step"]["host_samples"] == pytest.approx([2.0] * 3)


def test_a_run_stopped_by_sigterm_keeps_the_rounds_every_mode_finished(python_bench, monkeypatch):
    # What `timeout` does to a run that overstays: SIGTERM while the third
    # worker (round 2's first mode) runs. Round 1 is reported, the half of
    # round 2 that ran is not, and SIGTERM's handler is given back.
    calls = []

    def fake_worker(script, mode, passthrough, timeout):
        calls.append(mode)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_round(python_bench, mode, 100.0 + len(calls), {})

    monkeypatch.setattr(python_bench, "run_worker", fake_worker)
    monkeypatch.setattr(python_bench, "log", lambda message: None)
    before = signal.getsignal(signal.SIGTERM)
    args = types.SimpleNamespace(modes=["native", "streamalloc"], rounds=4, timeout=10)
    results, note = python_bench.run_workers(args, [])
    assert calls == ["native", "streamalloc", "streamalloc"]
    assert note == "Stopped by SIGTERM: the tables cover the 1 of 4 rounds that every mode finished."
    assert results["native"]["hf_llama_train_step"]["median_ms_per_round"] == [101.0]
    assert results["streamalloc"]["hf_llama_train_step"]["median_ms_per_round"] == [102.0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_run_stopped_before_every_mode_ran_reports_no_table(python_bench, monkeypatch):
    def fake_worker(script, mode, passthrough, timeout):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(python_bench, "run_worker", fake_worker)
    monkeypatch.setattr(python_bench, "log", lambda message: None)
    args = types.SimpleNamespace(modes=["native", "streamalloc"], rounds=2, timeout=10)
    with pytest.raises(SystemExit, match="stopped by SIGTERM before every mode had run once"):
        python_bench.run_workers(args, [])
