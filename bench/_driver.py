"""Shared by the Python benchmarks (python_bench.py, replay_torch.py,
ipc_bench.py, ...): the allocator modes they compare and the driver that
runs one mode in a fresh process of the calling script and reads back the
JSON result its worker wrote.
"""

import json
import os
import subprocess
import sys
import tempfile

# PYTORCH_CUDA_ALLOC_CONF of the torch modes that set one ("native" is
# torch's defaults).
TORCH_MODE_CONF = {"expandable": "expandable_segments:True", "cuda_async": "backend:cudaMallocAsync"}
# STREAMALLOC_CONF of the streamalloc modes other than "streamalloc" (its
# defaults).
STREAMALLOC_MODE_CONF = {"streamalloc_plain": "expandable_segments:False"}
# The allocator backend torch must report in each torch mode.
TORCH_MODE_BACKEND = {"native": "native", "expandable": "native", "cuda_async": "cudaMallocAsync"}
# Every variable that configures an allocator under test: each mode states
# its whole configuration, none leaks in from the caller's environment.
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "STREAMALLOC_CONF")


def mode_env(mode):
    """The environment of a process that runs `mode`."""
    env = dict(os.environ)
    for name in ALLOCATOR_VARIABLES:
        env.pop(name, None)
    if mode in TORCH_MODE_CONF:
        env["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_MODE_CONF[mode]
    if mode in STREAMALLOC_MODE_CONF:
        env["STREAMALLOC_CONF"] = STREAMALLOC_MODE_CONF[mode]
    env["PYTHONUNBUFFERED"] = "1"
    return env


def enter_mode(mode, tool):
    """In a worker process, before anything touches CUDA: installs streamalloc
    in the streamalloc modes (their settings come from STREAMALLOC_CONF,
    which mode_env sets), sets up the CUDA context and allocator outside any
    timing, and checks that torch's allocator backend is the mode's. Returns
    the torch module; `tool` names the caller in errors."""
    if mode == "streamalloc" or mode in STREAMALLOC_MODE_CONF:
        import streamalloc  # before torch makes any CUDA allocation

        streamalloc.install()
        if not streamalloc.is_installed():
            raise SystemExit(f"{tool}: streamalloc.install() returned but streamalloc is not installed")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{tool}: torch sees no CUDA device")
    torch.empty(1, device="cuda")
    backend = torch.cuda.get_allocator_backend()
    expected = TORCH_MODE_BACKEND.get(mode)
    if expected is not None and backend != expected:
        raise SystemExit(f"{tool}: mode {mode} expects torch allocator backend '{expected}', got '{backend}'")
    return torch


def run_worker(script, mode, args, timeout):
    """Runs `python SCRIPT --worker MODE --out FILE ARGS...` under
    mode_env(MODE), its stdout to our stderr, and returns the JSON object
    the worker wrote to FILE, or {"mode", "error"} when it failed, timed out
    or wrote nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(script), "--worker", mode, "--out", out_path, *args]
        try:
            proc = subprocess.run(command, env=mode_env(mode), stdout=sys.stderr, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": f"worker timed out after {timeout:.0f} s"}
        if proc.returncode == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        return {"mode": mode, "error": f"worker failed (exit status {proc.returncode})"}


def check_choices(parser, what, chosen, known):
    """Ends the run with argparse's usage error when `chosen` names anything
    outside `known` (`what` is the kind of name, as "mode")."""
    unknown = [x for x in chosen if x not in known]
    if unknown:
        parser.error(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}")


def finish(tool, modes, results, json_path):
    """Writes {"tool", "modes", "results"} to json_path when one is given, and
    returns the exit status of a run over `modes`: 1 when any mode failed."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"tool": tool, "modes": modes, "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1
