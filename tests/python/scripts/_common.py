"""Shared by the GPU test scripts: each runs one workload in a fresh
process and prints its measurements as one JSON line for the tests."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict

RESULT_PREFIX = "STREAMALLOC_RESULT "


def emit(result: Dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def select_allocator(mode: str) -> None:
    """'streamalloc' installs it; 'native' keeps torch's own allocator.
    Must run before anything touches CUDA."""
    if mode == "streamalloc":
        import streamalloc

        streamalloc.install()
    elif mode != "native":
        sys.exit(f"unknown allocator mode {mode!r} (expected native or streamalloc)")


def block_states(snapshot: Dict[str, Any]) -> Dict[int, str]:
    """Block address -> state, over every segment of a snapshot."""
    states = {}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            states[block.get("address", address)] = block["state"]
            address += block["size"]
    return states
