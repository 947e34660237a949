"""pytest setup for streamalloc's Python tests.

Tests marked `gpu` need torch with CUDA, a visible GPU and the compiled
extension (streamalloc._C); `torchvision` ones also need torchvision.
Without them they skip with the reason (shown by `pytest -rs`). Every
workload that installs streamalloc runs in a fresh subprocess (scripts/),
because install() must come before torch initialises CUDA; this process
never initialises CUDA itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
REPO = HERE.parents[1]
RESULT_PREFIX = "STREAMALLOC_RESULT "

# The installed package when there is one, else the in-tree sources (which
# lack the compiled parts: the GPU tests then skip).
try:
    import streamalloc  # noqa: F401
    IN_TREE_PATH: Optional[str] = None
except ImportError:
    IN_TREE_PATH = str(REPO / "python")
    sys.path.insert(0, IN_TREE_PATH)


@contextlib.contextmanager
def bench_module(name: str):
    """bench/NAME.py loaded as a module under test, with bench/ on sys.path
    for the modules it imports (_driver, python_bench) while it is used."""
    bench = str(REPO / "bench")
    sys.path.insert(0, bench)
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(bench)


def script_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    if IN_TREE_PATH is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (IN_TREE_PATH, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


@dataclass
class ScriptRun:
    returncode: int
    result: Optional[Dict[str, Any]]
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit code {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


def run_script(name: str, *args: str, timeout: float = 300, env: Optional[Dict[str, str]] = None) -> ScriptRun:
    """Runs scripts/<name> with this interpreter; its result is the JSON on
    the last line that starts with RESULT_PREFIX."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_env(env),
        cwd=str(SCRIPTS),
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    return ScriptRun(proc.returncode, result, proc.stdout, proc.stderr)


def run_ok(name: str, *args: str, timeout: float = 300) -> Dict[str, Any]:
    """run_script that fails the test unless the script succeeded."""
    run = run_script(name, *args, timeout=timeout)
    if run.returncode != 0 or run.result is None:
        pytest.fail(f"scripts/{name} {' '.join(args)} failed: {run.describe()}", pytrace=False)
    return run.result


class Scripts:
    """The `scripts` fixture: run(...) returns a ScriptRun whatever happened,
    run_ok(...) the script's result or a test failure with its output."""

    run = staticmethod(run_script)
    run_ok = staticmethod(run_ok)


_probe_cache: Dict[str, Any] = {}


def probe() -> Dict[str, Any]:
    """What this interpreter offers, asked in a subprocess (torch, CUDA,
    the extension, torchvision) so this process stays free of CUDA."""
    if not _probe_cache:
        run = run_script("probe.py", timeout=120)
        if run.result is None:
            _probe_cache.update(error=f"scripts/probe.py failed: {run.describe()}")
        else:
            _probe_cache.update(run.result)
    return _probe_cache


def gpu_skip_reason() -> Optional[str]:
    p = probe()
    if "error" in p:
        return p["error"]
    if p.get("torch") is None:
        return f"no usable torch: {p.get('torch_error')}"
    if not p.get("cuda"):
        return f"torch {p['torch']} sees no CUDA GPU"
    if not p.get("extension"):
        return f"streamalloc._C is not built: {p.get('extension_error')}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch with CUDA, a GPU and streamalloc._C")
    config.addinivalue_line("markers", "torchvision: also needs torchvision")


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    reason = gpu_skip_reason()
    for item in marked:
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("torchvision") and not probe().get("torchvision"):
            item.add_marker(pytest.mark.skip(reason=f"no torchvision: {probe().get('torchvision_error')}"))


@pytest.fixture(scope="session")
def scripts() -> Scripts:
    return Scripts()


@pytest.fixture(scope="session")
def environment() -> Dict[str, Any]:
    """probe()'s report of torch, CUDA, the extension and torchvision."""
    return probe()
