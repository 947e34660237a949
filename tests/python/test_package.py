"""The pure-Python side of the package, on any machine: importing without
torch or a GPU, option spelling, the summary table, and the errors GPU
functions raise when torch or the compiled extension is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

import streamalloc
from streamalloc._options import to_conf_string
from streamalloc._summary import format_bytes, format_summary


def test_import_does_not_load_torch():
    # The same copy of the package as this process imported.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(streamalloc.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    code = "import sys, streamalloc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_options_are_spelled_for_streamalloc_conf():
    text = to_conf_string({"max_split_size_mb": 256, "cross_stream_reuse": False, "memory_fraction": 0.5,
                           "roundup_power2_divisions": "4"})
    assert text == "max_split_size_mb:256,cross_stream_reuse:False,memory_fraction:0.5,roundup_power2_divisions:4"
    assert to_conf_string({}) == ""
    assert to_conf_string({"flag": True}) == "flag:True"


@pytest.mark.parametrize("key", ["", "a:b", "a,b", "a b"])
def test_option_names_that_cannot_be_spelled_are_rejected(key):
    with pytest.raises(ValueError, match="not a valid STREAMALLOC_CONF key"):
        to_conf_string({key: 1})


def test_option_values_of_other_types_are_rejected():
    with pytest.raises(TypeError, match="expected a bool, a number or a string"):
        to_conf_string({"max_split_size_mb": [256]})


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 << 20) == "3.00 MiB"
    assert format_bytes(5 << 40) == "5.00 TiB"


def _stats():
    stats = {}
    for prefix in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes",
                   "allocation", "segment", "active", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for column in ("current", "peak", "allocated", "freed"):
                stats[f"{prefix}.{pool}.{column}"] = 0
    stats.update({
        "allocated_bytes.all.current": 3 << 20,
        "allocated_bytes.all.peak": 5 << 20,
        "reserved_bytes.all.current": 20 << 20,
        "allocation.all.current": 1234567,
        "num_ooms": 2,
        "num_alloc_retries": 7,
        "fragmentation.largest_free_block_bytes": 12 << 20,
        "fragmentation.free_cached_bytes": 17 << 20,
        "fragmentation.external": 1 - 12 / 17,
        "fragmentation.reserved_allocated_ratio": 20 / 3,
    })
    return stats


def test_summary_has_torch_rows_and_fragmentation_lines():
    text = format_summary(_stats(), device=3)
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1, "every line of the table has the same width"
    assert "device 3" in lines[1]
    assert "OOMs: 2" in text and "allocation retries: 7" in text
    row = next(line for line in lines if line.startswith("| Allocated memory"))
    assert "3.00 MiB" in row and "5.00 MiB" in row
    assert "1,234,567" in text
    largest = next(line for line in lines if "Largest free cached block" in line)
    assert "12.00 MiB" in largest
    assert "17.00 MiB" in next(line for line in lines if "Free cached memory" in line)
    assert "0.294" in next(line for line in lines if "External fragmentation" in line)
    assert "6.667" in next(line for line in lines if "Reserved / allocated" in line)
    assert "from small pool" in text


def test_abbreviated_summary_drops_the_pool_rows():
    text = format_summary(_stats(), device=0, abbreviated=True)
    assert "from small pool" not in text and "Allocated memory" in text


def test_gpu_functions_explain_a_missing_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    with pytest.raises(ImportError, match="needs PyTorch"):
        streamalloc.install()
    with pytest.raises(ImportError, match="needs PyTorch"):
        streamalloc.stats()
    assert streamalloc.is_installed() is False


def test_gpu_functions_explain_a_missing_extension(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "streamalloc._C", None)  # `from . import _C` now fails
    monkeypatch.delattr(streamalloc, "_C", raising=False)
    with pytest.raises(ImportError, match=r"streamalloc\._C is missing.*pip install \."):
        streamalloc.snapshot()
    assert streamalloc.is_installed() is False


def test_library_path_names_the_shipped_library_or_explains():
    try:
        path = streamalloc.library_path()
    except RuntimeError as error:
        assert "libstreamalloc.so is not in" in str(error) and "pip install ." in str(error)
    else:
        assert path.endswith("/libstreamalloc.so")
