"""The tools a user touches, on any machine: plot_replay.py's one-line
error without matplotlib, the version the tools print, the build
backend's message without scikit-build-core and its wheel version; and
the developers' tools: the sampling profiler, scripts/pc-sampler, and
scale_traces.py and mix_traces.py."""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = re.search(r"project\(streamalloc\s+VERSION\s+([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)


def test_plot_replay_names_matplotlib_when_it_is_missing(tmp_path):
    # A matplotlib that fails to import stands in for a missing one.
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_replay.py"), "-o", str(tmp_path / "out.png"),
                          "streamalloc=" + str(tmp_path / "missing.csv")],
                         capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert "needs matplotlib" in lines[0] and "pip install matplotlib" in lines[0]


BACKEND = REPO / "python" / "build_backend" / "streamalloc_build.py"


def test_build_backend_without_scikit_build_core_says_what_to_install():
    code = ("import sys; sys.modules['scikit_build_core'] = None; "
            f"sys.path.insert(0, {str(BACKEND.parent)!r}); import streamalloc_build")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "scikit-build-core" in run.stderr and "--no-build-isolation" in run.stderr


def _backend_with_stub_skbuild(monkeypatch):
    stub = types.ModuleType("scikit_build_core")
    stub.build = types.ModuleType("scikit_build_core.build")
    monkeypatch.setitem(sys.modules, "scikit_build_core", stub)
    monkeypatch.setitem(sys.modules, "scikit_build_core.build", stub.build)
    spec = importlib.util.spec_from_file_location("streamalloc_build_under_test", BACKEND)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_version_is_cmake_version_with_the_torch_build(monkeypatch, tmp_path):
    backend = _backend_with_stub_skbuild(monkeypatch)
    assert backend.base_version() == VERSION
    assert backend.local_label("2.11.0+cu130", "13.0") == "torch2.11cu130"
    assert backend.local_label("2.7.1", "12.8") == "torch2.7cu128"
    assert backend.local_label("2.11.0+cpu", "") == "torch2.11cpu"
    assert backend.local_label("", "") == ""
    # The file scikit-build-core's regex provider reads.
    monkeypatch.setattr(backend, "VERSION_FILE", str(tmp_path / "_version.py"))
    monkeypatch.setattr(backend, "torch_versions", lambda: ("2.11.0+cu130", "13.0"))
    assert backend.write_version() == VERSION + "+torch2.11cu130"
    scope: dict = {}
    exec((tmp_path / "_version.py").read_text(), scope)
    assert scope["__version__"] == VERSION + "+torch2.11cu130"
    assert backend.write_version(with_label=False) == VERSION


def test_scripts_print_the_version():
    for script in ("plot_replay.py", "capture_trace.py", "config_doc.py", "scale_traces.py", "mix_traces.py"):
        run = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--version"],
                             capture_output=True, text=True, check=True)
        assert run.stdout.strip() == f"{script} {VERSION}"


def test_scale_traces_scales_every_request_and_drops_native_segments(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = ["action,addr,size,stream", "segment_alloc,4096,20971520,0", "alloc,4096,1000,0",
            "alloc,8192,3,7", "free_requested,4096,1000,0", "free_completed,4096,1000,0", "alloc,9000,0,0"]
    with gzip.open(src / "a.trace.csv.gz", "wt") as f:
        f.write("\n".join(rows) + "\n")
    (src / "b.trace.csv").write_text("action,addr,size,stream\nalloc,1,10,0\n")
    (src / "notes.txt").write_text("not a trace")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "scale_traces.py"), str(src), str(tmp_path / "out"),
                          "0.25"], capture_output=True, text=True, check=True)
    assert "2 traces scaled by 0.25" in run.stdout
    with gzip.open(tmp_path / "out" / "a.trace.csv.gz", "rt") as f:
        assert f.read().splitlines() == ["action,addr,size,stream", "alloc,4096,250,0", "alloc,8192,1,7",
                                         "free_requested,4096,250,0", "free_completed,4096,250,0",
                                         "alloc,9000,0,0"]
    assert (tmp_path / "out" / "b.trace.csv").read_text().splitlines() == ["action,addr,size,stream", "alloc,1,2,0"]
    assert not (tmp_path / "out" / "notes.txt").exists()
    # Columns in another order, and one more, are kept as they are.
    (src / "a.trace.csv.gz").unlink()
    (src / "b.trace.csv").write_text('stream,size,action,addr,frames\n0,10,alloc,1,"x.py:1, in f"\n'
                                     "0,4096,segment_alloc,1,\n")
    subprocess.run([sys.executable, str(REPO / "scripts" / "scale_traces.py"), str(src), str(tmp_path / "out2"), "0.5"],
                   capture_output=True, text=True, check=True)
    assert (tmp_path / "out2" / "b.trace.csv").read_text().splitlines() == [
        "stream,size,action,addr,frames", '0,5,alloc,1,"x.py:1, in f"']
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "scale_traces.py"), str(src),
                              str(tmp_path / "never"), "0"], capture_output=True, text=True)
    assert refused.returncode != 0 and "factor must be positive" in refused.stderr
    assert not (tmp_path / "never").exists()


def test_mix_traces_interleaves_two_traces_in_proportion_apart_in_memory(tmp_path):
    a = tmp_path / "a.trace.csv.gz"
    with gzip.open(a, "wt") as f:
        f.write("action,addr,size,stream\nsegment_alloc,4096,2097152,0\nalloc,4096,100,0\nalloc,8192,50,5\n"
                "free_requested,4096,100,0\nfree_completed,4096,100,0\n")
    b = tmp_path / "b.trace.csv"
    # Columns in another order; a stream that A also uses (5) must be renamed.
    b.write_text("stream,addr,action,size\n0,4096,alloc,7\n5,65536,alloc,9\n")
    script = str(REPO / "scripts" / "mix_traces.py")
    run = subprocess.run([sys.executable, script, str(a), str(b), str(tmp_path / "m.csv")],
                         capture_output=True, text=True, check=True)
    assert "4 + 2 events" in run.stdout
    rows = (tmp_path / "m.csv").read_text().splitlines()
    shift = (8192 + 50 + 2**30) // 2**30 * 2**30 - 4096 + 2**30
    # A's events at 0, 1/4, 2/4, 3/4; B's at 0 and 1/2, after A's on a tie.
    assert rows == ["action,addr,size,stream", "alloc,4096,100,0", f"alloc,{4096 + shift},7,0", "alloc,8192,50,5",
                    "free_requested,4096,100,0", f"alloc,{65536 + shift},9,6", "free_completed,4096,100,0"]
    subprocess.run([sys.executable, script, "--own-default-stream", str(a), str(b), str(tmp_path / "o.csv")],
                   capture_output=True, text=True, check=True)
    streams = [row.split(",")[3] for row in (tmp_path / "o.csv").read_text().splitlines()[1:]]
    assert streams == ["0", "6", "5", "0", "7", "0"]
    # B keeps only its frees' requests: they become completions, or B would never free once mixed.
    b.write_text("action,addr,size,stream\nalloc,4096,7,0\nfree_requested,4096,7,0\n")
    subprocess.run([sys.executable, script, str(a), str(b), str(tmp_path / "r.csv")],
                   capture_output=True, text=True, check=True)
    assert f"free_completed,{4096 + shift},7,0" in (tmp_path / "r.csv").read_text().splitlines()
    (tmp_path / "empty.csv").write_text("action,addr,size,stream\nsegment_alloc,1,2,0\n")
    refused = subprocess.run([sys.executable, script, str(a), str(tmp_path / "empty.csv"), str(tmp_path / "x.csv")],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "has no alloc or free event" in refused.stderr
    assert not (tmp_path / "x.csv").exists()


def test_capture_trace_writes_the_blocks_live_before_recording_began(tmp_path):
    # Recording began with 4096 (live to the end) and 8192 (freed in the
    # trace) allocated; 12288 was allocated and freed while recording.
    snapshot = {
        "segments": [
            {"device": 0, "address": 4096, "stream": 7, "blocks": [
                {"address": 4096, "size": 1536, "state": "active_allocated"},
                {"address": 5632, "size": 512, "state": "inactive"},
            ]},
            {"device": 1, "address": 4096, "stream": 0, "blocks": [
                {"address": 4096, "size": 99, "state": "active_allocated"},
            ]},
        ],
        "device_traces": [[
            {"action": "segment_free", "addr": 65536, "size": 2097152, "stream": 0},
            {"action": "alloc", "addr": 12288, "size": 1024, "stream": 0},
            {"action": "free_completed", "addr": 8192, "size": 2048, "stream": 0},
            {"action": "free_completed", "addr": 12288, "size": 1024, "stream": 0},
        ]],
    }
    pickle_path = tmp_path / "snap.pickle"
    pickle_path.write_bytes(pickle.dumps(snapshot))
    out = tmp_path / "t.trace.csv"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "capture_trace.py"), "-o", str(out),
                          "--from-pickle", str(pickle_path)], capture_output=True, text=True, check=True)
    assert out.read_text().splitlines() == [
        "action,addr,size,stream", "alloc,4096,1536,7", "segment_free,65536,2097152,0", "alloc,12288,1024,0",
        "free_completed,8192,2048,0", "free_completed,12288,1024,0"]
    assert "1 block (1,536 B) live before recording began" in run.stderr
    assert "1 block (2,048 B) are freed without an alloc" in run.stderr
    # 4096 and 8192 live from the start, then 12288 too: 4,608 B; native
    # held them and the 2 MiB segment it freed.
    assert "peak live 4,608 B, native peak reserved 2,101,760 B" in run.stderr


# A stand-in for the torch calls capture_trace.py makes, so that its way of
# running a program is checked without a GPU: the program's allocations
# (stand_in_alloc) become the recorded trace.
STAND_IN_TORCH = """
_entries = []
_recording = [False]

def stand_in_alloc(addr, size):
    if _recording[0]:
        _entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})

class _memory:
    @staticmethod
    def _record_memory_history(enabled=None, **kwargs):
        _recording[0] = enabled is not None
    @staticmethod
    def _snapshot():
        return {"segments": [], "device_traces": [list(_entries)]}

class cuda:
    memory = _memory
    is_available = staticmethod(lambda: True)
    get_allocator_backend = staticmethod(lambda: "native")
    synchronize = staticmethod(lambda: None)
    current_device = staticmethod(lambda: 0)
"""


@pytest.mark.parametrize("ending, status", [("raise MemoryError('out of memory')", 1), ("sys.exit(3)", 3),
                                            ("pass", 0)])
def test_capture_trace_writes_the_trace_of_a_program_that_fails(tmp_path, ending, status):
    (tmp_path / "torch.py").write_text(STAND_IN_TORCH)
    program = tmp_path / "prog.py"
    program.write_text(f"import sys\nimport torch\ntorch.stand_in_alloc(4096, 512)\n{ending}\n")
    out = tmp_path / "t.trace.csv"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "capture_trace.py"), "-o", str(out), "--",
                          str(program)], capture_output=True, text=True, env=env)
    assert run.returncode == status, run.stderr
    assert out.read_text().splitlines() == ["action,addr,size,stream", "alloc,4096,512,0"]
    if status:
        assert f"ended with status {status}; writing the trace so far" in run.stderr
    if ending.startswith("raise"):
        assert "MemoryError: out of memory" in run.stderr


def load_script(folder, name):
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    sys.path.insert(0, str(REPO / folder))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / folder))
    return module


def test_trace_csv_puts_blocks_freed_before_allocated_first_and_bounds_native():
    trace_csv = load_script("scripts", "trace_csv")
    events = [("segment_free", 0, 20971520, 0), ("alloc", 8192, 3000, 0), ("free_completed", 4096, 1000, 5),
              ("free_completed", 8192, 3000, 0)]
    replayed = trace_csv.with_allocations_before_recording(events)
    assert replayed == [("alloc", 4096, 1000, 5), *events]
    curve = []
    assert trace_csv.native_figures(replayed, curve) == (4000, 20971520 + 4000, 20971520 + 4000)
    assert curve[0] == (1000, 20971520 + 4000)
    assert trace_csv.native_figures([("alloc", 1, 512, 0)]) == (512, 0, 0)
    recorded_from_start = [("segment_alloc", 0, 2097152, 0), ("alloc", 0, 512, 0)]
    assert trace_csv.native_figures(recorded_from_start) == (512, 2097152, 0)
    assert trace_csv.with_allocations_before_recording(events[1:2]) == events[1:2]
    # A second free of one address is not read as an allocation before recording.
    double_free = [("alloc", 1, 512, 0), ("free_completed", 1, 512, 0), ("free_completed", 1, 512, 0)]
    assert trace_csv.allocations_before_recording(double_free) == []


def test_trace_csv_reads_columns_in_any_order_and_skips_unknown_actions(tmp_path):
    trace_csv = load_script("scripts", "trace_csv")
    path = tmp_path / "t.trace.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write('Stream,size,frames,addr,action\n7,512,"a.py:1, in f",4096,alloc\n0,2097152,,0,segment_alloc\n'
                "7,512,,4096,segment_resize\n7,512,,4096,free_completed\n")
    events, lines, skipped = trace_csv.read_events(str(path), ("alloc", "free_completed"))
    assert events == [("alloc", 4096, 512, 7), ("free_completed", 4096, 512, 7)]
    assert lines == 4
    assert skipped == {"segment_resize": 1}
    assert trace_csv.describe_skipped(skipped) == "1 line of actions the trace format does not name: segment_resize (1)"
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfaction,addr,size,stream\nalloc,1,2,0\n")
    assert trace_csv.read_events(str(bom), ("alloc",))[0] == [("alloc", 1, 2, 0)]
    floats = tmp_path / "floats.csv"
    floats.write_text("action,addr,size,stream\nalloc,4096.0,512.00,0.0\noom,,1024,0\n")
    assert trace_csv.read_events(str(floats), ("alloc",))[0] == [("alloc", 4096, 512, 0)]
    hexadecimal = tmp_path / "hex.csv"
    hexadecimal.write_text("action,addr,size,stream\nalloc,0x7F7500001000,0x200,0x55aa\n")
    assert trace_csv.read_events(str(hexadecimal), ("alloc",))[0] == [("alloc", 0x7F7500001000, 512, 0x55AA)]
    for bad_number in ("0x", "0x1g", "0x-1", "0x10.0"):
        hexadecimal.write_text(f"action,addr,size,stream\nalloc,{bad_number},512,0\n")
        with pytest.raises(trace_csv.TraceFormatError, match="must be numbers"):
            trace_csv.read_events(str(hexadecimal), ("alloc",))
    floats.write_text("action,addr,size,stream\nalloc,4096,512.5,0\n")
    with pytest.raises(trace_csv.TraceFormatError, match="must be numbers"):
        trace_csv.read_events(str(floats), ("alloc",))
    bad = tmp_path / "bad.csv"
    bad.write_text("action,addr,size\nalloc,1,2\n")
    with pytest.raises(trace_csv.TraceFormatError, match="which lacks 'stream'"):
        trace_csv.read_events(str(bad), ("alloc",))
    bad.write_text("action,addr,size,stream,addr\n")
    with pytest.raises(trace_csv.TraceFormatError, match="names column 'addr' twice"):
        trace_csv.read_events(str(bad), ("alloc",))


SAMPLED_PROGRAM = r"""
#include <pthread.h>
#include <stdio.h>

__attribute__((noinline)) unsigned long spin_in_worker(unsigned long rounds) {
  volatile unsigned long sum = 0;
  for (unsigned long i = 0; i < rounds; ++i) sum += i;
  return sum;
}

static void* worker(void* arg) {
  (void)arg;
  spin_in_worker(200000000UL);
  return NULL;
}

int main(void) {
  pthread_t threads[2];
  for (int i = 0; i < 2; ++i) pthread_create(&threads[i], NULL, worker, NULL);
  for (int i = 0; i < 2; ++i) pthread_join(threads[i], NULL);
  puts("done");
  return 0;
}
"""


def test_pc_sampler_finds_where_started_threads_spend_their_time(tmp_path):
    missing = [tool for tool in ("gcc", "g++", "addr2line") if shutil.which(tool) is None]
    if missing:
        pytest.skip("scripts/pc-sampler needs " + ", ".join(missing))
    program = tmp_path / "spin"
    (tmp_path / "spin.c").write_text(SAMPLED_PROGRAM)
    subprocess.run(["gcc", "-O1", "-g", "-pthread", "-o", str(program), str(tmp_path / "spin.c")], check=True)
    report = tmp_path / "report.txt"
    run = subprocess.run([str(REPO / "scripts" / "pc-sampler" / "run.sh"), str(report), str(program)],
                         capture_output=True, text=True, env={"PC_SAMPLER_US": "500", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
    text = report.read_text()
    lines = text.splitlines()
    first = lines.index("innermost function:") + 1
    innermost = [line.split(maxsplit=2) for line in lines[first:lines.index("", first)]]
    # The started threads are sampled where they spin; the main thread
    # waits in libc's join meanwhile.
    outside_libc = [(int(count), name) for count, _, name in innermost if "(libc" not in name]
    assert outside_libc, text
    assert outside_libc[0][1] == "spin_in_worker", text
    assert outside_libc[0][0] > 100, text
