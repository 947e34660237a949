"""bench/python_bench.py's driver side, on any machine: how it pools rounds,
takes the allocator's share of torch.empty+del within each process, prints
only the parts it ran, and rejects unknown parts. The workers themselves
need a GPU and run in scripts/gpu-bench.sh."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "python_bench.py"


@pytest.fixture(scope="module")
def python_bench():
    sys.path.insert(0, str(SCRIPT.parent))  # for its _driver
    try:
        spec = importlib.util.spec_from_file_location("python_bench_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def empty_del_round(bench, base_ns, extra_ns):
    """One worker's empty_del result: every sample of a size is base_ns plus
    that size's extra_ns (0 for the 0 B row)."""
    result = {}
    for label, _ in bench.EMPTY_SIZES:
        samples = [base_ns + extra_ns.get(label, 0)] * 3
        result[label] = {"ns_per_pair": bench.summarize(samples), "samples": samples, "iterations": 10, "reps": 3}
    return result


def worker_result(bench, mode, base_ns, extra_ns):
    return {"mode": mode, "torch": "t", "device": "d", "cpu": 3, "wall_s": 1.0,
            "empty_del": empty_del_round(bench, base_ns, extra_ns)}


def test_the_allocator_share_is_taken_within_each_process(python_bench):
    # Two processes of one mode whose Python speed differs by 1000 ns: the
    # pooled medians move with it, the per-process shares do not.
    extra = {"256 B": 50, "64 KiB": 60, "4 MiB": 70, "64 MiB": 80}
    rounds = [worker_result(python_bench, "native", 2000, extra), worker_result(python_bench, "native", 3000, extra)]
    merged = python_bench.merge_rounds("native", rounds)
    assert merged["rounds"] == 2
    for label, share in extra.items():
        assert merged["empty_del"][label]["allocator_share_ns_per_round"] == [share, share]
    assert "allocator_share_ns_per_round" not in merged["empty_del"][python_bench.BASELINE]
    assert merged["empty_del"]["256 B"]["ns_per_pair"]["min"] == 2050
    assert merged["empty_del"]["256 B"]["ns_per_pair"]["max"] == 3050


def test_tables_cover_only_the_parts_that_ran(python_bench, capsys):
    native = python_bench.merge_rounds("native", [worker_result(python_bench, "native", 2000, {"4 MiB": 100})])
    ours = python_bench.merge_rounds("streamalloc", [worker_result(python_bench, "streamalloc", 2600, {"4 MiB": 40})])
    python_bench.print_tables({"native": native, "streamalloc": ours}, ["native", "streamalloc"])
    out = capsys.readouterr().out
    assert "every process on CPU 3" in out
    assert "| 4 MiB | 100 ns [100, 100] | 40 ns [40, 40] | -60 ns |" in out
    assert "| 0 B | 2.00 us [2.00, 2.00] | 2.60 us [2.60, 2.60] | 0.77x |" in out
    assert "training step" not in out and "Peak memory" not in out


def test_unknown_parts_are_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--parts", "empty_del,warp_drive"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "unknown part(s) warp_drive" in run.stderr
