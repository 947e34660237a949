"""The trace-corpus workloads (bench/workloads) and their capture script,
on any machine: every workload compiles, the names other scripts import
from the workloads exist, scripts/capture_corpus.sh lists
exactly the traces tests/data/traces/README.md describes, and, where torch,
torchvision and transformers import (and peft, for lora_finetune), each
workload runs its code path on the CPU with a tiny model (`--device cpu
--tiny`); without them those runs skip with the reason."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import py_compile
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = REPO / "bench" / "workloads"
CAPTURE_CORPUS = REPO / "scripts" / "capture_corpus.sh"
TRACES_README = REPO / "tests" / "data" / "traces" / "README.md"
# The workloads that predate the corpus take no --device/--tiny.
CUDA_ONLY = {"gpt2_train_varlen.py", "gpt2_generate.py", "resnet50_train_fixed.py"}


def corpus():
    """(trace name, script, arguments) as capture_corpus.sh --list prints them."""
    out = subprocess.run(["bash", str(CAPTURE_CORPUS), "--list"], capture_output=True, text=True, check=True)
    entries = []
    for line in out.stdout.splitlines():
        name, script, *args = line.split()
        entries.append((name, Path(script).name, args))
    return entries


@pytest.mark.parametrize("script", sorted(p.name for p in WORKLOADS.glob("*.py")))
def test_workload_compiles(script, tmp_path):
    py_compile.compile(str(WORKLOADS / script), cfile=str(tmp_path / "out.pyc"), doraise=True)


def workload_imports():
    """(importing file, workload module, name) for every `from M import N`
    in the project's Python scripts whose M is a workload module."""
    modules = {p.stem for p in WORKLOADS.glob("*.py")}
    folders = [REPO / "bench", WORKLOADS, REPO / "scripts", REPO / "tests" / "python" / "scripts"]
    found = []
    for path in [p for folder in folders for p in sorted(folder.glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                found.extend((path.relative_to(REPO).as_posix(), node.module, a.name) for a in node.names)
    return found


def top_level_names(module):
    names = set()
    for node in ast.parse((WORKLOADS / f"{module}.py").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_names_imported_from_workloads_exist():
    # The benchmarks import workload functions inside functions that run
    # only on a GPU; a renamed function would otherwise surface there first.
    imports = workload_imports()
    importers = {importer for importer, _, _ in imports}
    assert {"bench/python_bench.py", "tests/python/scripts/train.py"} <= importers
    missing = [f"{importer}: {module}.{name}" for importer, module, name in imports
               if name not in top_level_names(module)]
    assert missing == []


def test_corpus_scripts_exist_and_names_are_unique():
    entries = corpus()
    assert len(entries) >= 12
    names = [name for name, _, _ in entries]
    assert len(names) == len(set(names))
    for _, script, _ in entries:
        assert (WORKLOADS / script).is_file(), script


def test_readme_describes_every_trace_of_the_corpus():
    readme = TRACES_README.read_text()
    described = set(re.findall(r"^\| `([a-z0-9_]+)\.trace\.csv\.gz` \|", readme, flags=re.M))
    assert described == {name for name, _, _ in corpus()}


def test_committed_traces_are_in_the_corpus():
    committed = {p.name.split(".trace.csv")[0] for p in (REPO / "tests" / "data" / "traces").glob("*.trace.csv*")}
    assert committed <= {name for name, _, _ in corpus()}


# Modules a workload needs beyond torch, torchvision and transformers.
EXTRA_MODULES = {"lora_finetune.py": ("peft",)}


def _missing_modules(script=None):
    wanted = ("torch", "torchvision", "transformers", *EXTRA_MODULES.get(script, ()))
    return [m for m in wanted if importlib.util.find_spec(m) is None]


def _run_tiny(script, args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # Several runs share the cores: each keeps to two threads.
    env.setdefault("OMP_NUM_THREADS", "2")
    try:
        return subprocess.run(
            [sys.executable, str(WORKLOADS / script), *args, "--device", "cpu", "--tiny", "--steps", "2"],
            capture_output=True, text=True, timeout=600, env=env,
        )
    except subprocess.TimeoutExpired as e:
        return e


@pytest.fixture(scope="module")
def tiny_run(request):
    """name -> the finished tiny CPU run of that workload. The selected runs
    start together when the first test needs one, a run per two cores: one
    after another they took several minutes on a 16-core host. Under
    pytest-xdist, whose workers already run tests side by side (and each of
    which would start every run), each test runs its own workload alone."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return lambda name, script, args: _run_tiny(script, args)
    selected = [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_workload_runs_tiny_on_the_cpu"
        and not _missing_modules(item.callspec.params["script"])
    ]
    workers = max(1, (os.cpu_count() or 2) // 2)
    pool = ThreadPoolExecutor(max_workers=workers)
    request.addfinalizer(pool.shutdown)
    futures = {p["name"]: pool.submit(_run_tiny, p["script"], p["args"]) for p in selected}
    return lambda name, script, args: futures[name].result()


@pytest.mark.parametrize("name,script,args", [e for e in corpus() if e[1] not in CUDA_ONLY])
def test_workload_runs_tiny_on_the_cpu(name, script, args, tiny_run):
    missing = _missing_modules(script)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not importable here)")
    proc = tiny_run(name, script, args)
    assert not isinstance(proc, subprocess.TimeoutExpired), f"{name}: still running after {proc.timeout} s"
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), name


def test_workload_time_runs_workloads_and_prints_their_times(tmp_path):
    missing = _missing_modules()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not importable here)")
    out = tmp_path / "times.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "workload_time.py"), "--smoke", "--workloads", "bert_serve,moe_train",
         "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO / "bench",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| bert_serve |", "| moe_train |"))]
    assert len(rows) == 2, proc.stdout
    runs = json.loads(out.read_text())
    for name in ("bert_serve", "moe_train"):
        assert [r["mode"] for r in runs[name]["native"]] == ["native", "native"]
        assert all(r["seconds"] > 0 for r in runs[name]["native"])


def test_workload_time_rejects_names_outside_the_corpus():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "workload_time.py"), "--workloads", "no_such_trace"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "not in the corpus: ['no_such_trace']" in proc.stderr
