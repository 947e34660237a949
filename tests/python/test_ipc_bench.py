"""bench/ipc_bench.py on any machine: its table, its argument checks, and a
run's JSON and exit status with stand-in workers.
The workers need a GPU and run in scripts/gpu-bench.sh's ipc_bench step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import bench_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "ipc_bench.py"


@pytest.fixture(scope="module")
def ipc_bench():
    with bench_module("ipc_bench") as module:
        yield module


def test_the_table_has_a_row_per_size_and_mode_and_shows_failures(ipc_bench, capsys):
    def figures(base):
        return {step: ipc_bench.summarize([base + i for i in range(10)]) for step in ipc_bench.STEPS}

    results = {
        "native": {"sizes": {label: figures(10.0 * (n + 1)) for n, (label, _) in enumerate(ipc_bench.SIZES)}},
        "streamalloc": {"mode": "streamalloc", "error": "worker failed (exit status 1)"},
    }
    ipc_bench.print_table(results, ["native", "streamalloc"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| size | allocator | receive | read last element | release |"
    assert len(rows) == 1 + 2 * len(ipc_bench.SIZES)
    # Ten samples base..base+9: median base+4.5, p10 base, p90 base+8.
    assert rows[1] == "| 20 B | native | 14.5 us [10.0, 18.0] | 14.5 us [10.0, 18.0] | 14.5 us [10.0, 18.0] |"
    assert rows[2] == "| 20 B | streamalloc | failed: worker failed (exit status 1) | | |"


@pytest.mark.parametrize("args, message", [
    (["--modes", "native,cuda_async"], "unknown mode(s) cuda_async"),
    (["--count", "5", "--warmup", "10"], "--count must be larger than --warmup"),
])
def test_bad_arguments_are_refused_before_any_worker_starts(args, message):
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_run_writes_every_mode_to_the_json_and_fails_when_one_mode_failed(ipc_bench, monkeypatch, tmp_path, capsys):
    # The workers need a GPU; stand-ins return what a worker's JSON holds.
    def fake_worker(script, mode, args, timeout):
        assert args == ["--count=3", "--warmup=1"]
        if mode == "streamalloc":
            return {"mode": mode, "error": "worker timed out after 5 s"}
        samples = {step: ipc_bench.summarize([1.0, 2.0]) for step in ipc_bench.STEPS}
        return {"mode": mode, "sizes": {label: samples for label, _ in ipc_bench.SIZES}}

    monkeypatch.setattr(ipc_bench, "run_worker", fake_worker)
    out = tmp_path / "ipc.json"
    for modes, status in (("native,streamalloc", 1), ("native", 0)):
        monkeypatch.setattr(sys, "argv", ["ipc_bench.py", "--modes", modes, "--count", "3", "--warmup", "1",
                                          "--timeout", "5", "--json", str(out)])
        assert ipc_bench.main() == status
        written = json.loads(out.read_text())
        assert written["tool"] == "ipc_bench" and written["modes"] == modes.split(",")
        assert sorted(written["results"]) == sorted(modes.split(","))
    assert "| 20 B | native | 1.5 us" in capsys.readouterr().out
