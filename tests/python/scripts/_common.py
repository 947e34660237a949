"""Shared by the GPU test scripts: each runs one workload in a fresh
process and prints its measurements as one JSON line for the tests."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

RESULT_PREFIX = "STREAMALLOC_RESULT "
# bench/workloads, home of the GPT-2-style model the training scripts share
# with the benchmarks (gpt2_model.py): put it on sys.path to import it.
BENCH_WORKLOADS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../bench/workloads"))


def emit(result: Dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def select_allocator(mode: str) -> None:
    """'streamalloc' installs it with its defaults (expandable segments where
    the GPU supports them), 'streamalloc_plain' with one cudaMalloc per
    segment; 'native' keeps torch's own allocator. Must run before anything
    touches CUDA."""
    if mode in ("streamalloc", "streamalloc_plain"):
        import streamalloc

        streamalloc.install(**({"expandable_segments": False} if mode == "streamalloc_plain" else {}))
    elif mode != "native":
        sys.exit(f"unknown allocator mode {mode!r} (expected native, streamalloc or streamalloc_plain)")


def block_states(snapshot: Dict[str, Any]) -> Dict[int, str]:
    """Block address -> state, over every segment of a snapshot."""
    states = {}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            states[block.get("address", address)] = block["state"]
            address += block["size"]
    return states
