"""bench/replay_torch.py on a trace recorded mid-run and written by another
tool (columns in another order, one more column, an action the format does
not name): what it reads on any machine, its streamalloc column through
streamalloc-replay on the simulated device, and torch's own allocators on
a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import bench_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "replay_torch.py"
MiB = 1 << 20

# Block 8192 is freed before any alloc names it: it was allocated before
# recording began. Native had a 20 MiB segment then, which it gives back.
TRACE_ROWS = [
    ("segment_free", 1 << 30, 20 * MiB, 0),
    ("alloc", 4096, 1 * MiB, 0),
    ("free_completed", 8192, 4 * MiB, 0),
    ("workspace_snapshot", 0, 0, 0),
    ("alloc", 1 << 24, 8 * MiB, 0),
    ("free_completed", 4096, 1 * MiB, 0),
    ("free_completed", 1 << 24, 8 * MiB, 0),
]
PEAK_LIVE = 9 * MiB  # 1 + 8 MiB; 4 + 1 MiB before it


@pytest.fixture()
def foreign_trace(tmp_path):
    path = tmp_path / "foreign.trace.csv"
    lines = ["stream,size,addr,action,frames"]
    lines += [f'{stream},{size},{addr},{action},"model.py:{i}, in forward"'
              for i, (action, addr, size, stream) in enumerate(TRACE_ROWS)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def replay_torch():
    with bench_module("replay_torch") as module:
        yield module


def replay_binary():
    path = Path(os.environ.get("STREAMALLOC_REPLAY_BIN", REPO / "build" / "bin" / "streamalloc-replay"))
    if not path.is_file():
        pytest.skip(f"no streamalloc-replay at {path} (build it, or set STREAMALLOC_REPLAY_BIN)")
    return path


def run_replay_torch(tmp_path, trace, *args):
    out = tmp_path / "replay.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out), str(trace)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())["results"]["foreign"], run


def test_read_trace_puts_blocks_freed_before_allocated_first(replay_torch, foreign_trace, capsys):
    events, lines = replay_torch.read_trace(str(foreign_trace), replay_torch.RECORDED)
    assert lines == len(TRACE_ROWS)
    assert events[0] == ("alloc", 8192, 4 * MiB, 0)
    assert "skipped 1 line of actions the trace format does not name: workspace_snapshot (1)" in capsys.readouterr().err
    peak_live, native_peak, curve, before = replay_torch.trace_figures(events)
    assert peak_live == PEAK_LIVE
    # Native gave back 20 MiB and still held the 9 MiB live at the peak: it
    # had at least 29 MiB before recording began.
    assert before == 20 * MiB + PEAK_LIVE
    assert native_peak == before
    assert curve[0] == (4 * MiB, before)


def test_read_trace_frees_at_requests_when_no_free_is_completed(replay_torch, tmp_path, capsys):
    path = tmp_path / "requests.trace.csv"
    path.write_text("action,addr,size,stream\nalloc,0x1000,512,0x7f00\nfree_requested,0x1000,512,0x7f00\n"
                    "alloc,0x2000,1024,0x7f00\n")
    events, _ = replay_torch.read_trace(str(path), replay_torch.REPLAYED)
    assert events == [("alloc", 4096, 512, 0x7F00), ("free_completed", 4096, 512, 0x7F00),
                      ("alloc", 8192, 1024, 0x7F00)]
    assert "no free_completed line; 1 free_requested replayed as frees" in capsys.readouterr().err
    assert replay_torch.trace_figures(events)[0] == 1024
    # With a free_completed anywhere, requests are only requests.
    path.write_text("action,addr,size,stream\nalloc,1,512,0\nfree_requested,1,512,0\nfree_completed,1,512,0\n"
                    "alloc,2,1024,0\nfree_requested,2,1024,0\n")
    events, _ = replay_torch.read_trace(str(path), replay_torch.REPLAYED)
    assert events == [("alloc", 1, 512, 0), ("free_completed", 1, 512, 0), ("alloc", 2, 1024, 0)]
    assert "free_requested replayed" not in capsys.readouterr().err


def test_the_streamalloc_column_replays_on_the_simulated_device(tmp_path, foreign_trace):
    result, run = run_replay_torch(tmp_path, foreign_trace, "--modes", "", "--streamalloc-replay",
                                   str(replay_binary()), "--streamalloc-backend", "sim")
    assert result["events"] == len(TRACE_ROWS)
    assert result["peak_live_bytes"] == PEAK_LIVE
    assert result["modes"]["recorded"]["lower_bound"] is True
    for column in ("streamalloc", "streamalloc_plain"):
        mode = result["modes"][column]
        assert "error" not in mode, mode
        assert mode["peak_live_bytes"] == PEAK_LIVE
        assert mode["peak_allocated_bytes"] == PEAK_LIVE
        assert mode["peak_reserved_bytes"] >= PEAK_LIVE
    assert "| foreign | 7 | " in run.stdout
    assert "workspace_snapshot" in run.stderr


@pytest.mark.gpu
def test_torchs_allocators_replay_it_on_the_gpu(tmp_path, foreign_trace):
    result, _ = run_replay_torch(tmp_path, foreign_trace, "--modes", "native,expandable,cuda_async",
                                 "--streamalloc-replay", str(replay_binary()))
    assert result["peak_live_bytes"] == PEAK_LIVE
    for column in ("native", "expandable", "cuda_async", "streamalloc", "streamalloc_plain"):
        mode = result["modes"][column]
        assert "error" not in mode, (column, mode)
        assert mode["peak_reserved_bytes"] >= PEAK_LIVE, (column, mode)
