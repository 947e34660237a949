"""bench/ipc_bench.py on any machine: its table and its argument checks.
The workers need a GPU and run in scripts/gpu-bench.sh's ipc_bench step."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "ipc_bench.py"


@pytest.fixture(scope="module")
def ipc_bench():
    sys.path.insert(0, str(SCRIPT.parent))  # for _driver and python_bench
    try:
        spec = importlib.util.spec_from_file_location("ipc_bench_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


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
