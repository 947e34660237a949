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


def test_library_path_finds_the_built_library_or_explains():
    from streamalloc import _libraries

    try:
        path = streamalloc.library_path()
    except RuntimeError as error:
        # No CUDA toolkit where this copy was built: the message says how to get one.
        assert "libstreamalloc.so" in str(error) and "pip install ." in str(error)
        assert _libraries.find("libstreamalloc.so") is None
    else:
        assert path.endswith("/libstreamalloc.so") and os.path.isfile(path)


def test_library_path_in_a_checkout_uses_what_setup_sh_built():
    from streamalloc import _libraries

    root = _libraries.source_root()
    if root is None:
        pytest.skip("the package under test is an installed copy, not a checkout")
    built = os.path.join(root, "build", "lib", "libstreamalloc.so")
    if not os.path.isfile(built):
        pytest.skip(f"{built} is not built (scripts/setup.sh builds it when the CUDA toolkit is present)")
    assert streamalloc.library_path() == built


def test_namespace_exports_only_public_names():
    public = {name for name in dir(streamalloc) if not name.startswith("_")}
    # `streams` and `diagnosis` are the public submodules behind PinnedPool,
    # Prefetcher, to_device and the diagnosis functions.
    assert public == set(streamalloc.__all__) | {"streams", "diagnosis"}
    for name in streamalloc.__all__:
        assert getattr(streamalloc, name).__doc__, f"streamalloc.{name} has no docstring"


def test_version_comes_from_cmakelists():
    import re

    from streamalloc import _libraries

    cmake = open(os.path.join(os.path.dirname(__file__), "..", "..", "CMakeLists.txt")).read()
    version = re.search(r"project\(streamalloc\s+VERSION\s+([0-9.]+)", cmake).group(1)
    if _libraries.source_root() is not None:
        assert streamalloc.__version__ == version
    else:  # an installed wheel: the version plus its torch/CUDA label
        assert re.fullmatch(re.escape(version) + r"(\+torch\d+\.\d+(cu\d+|cpu))?", streamalloc.__version__)


@pytest.fixture
def config_library(monkeypatch):
    from streamalloc import _config, _libraries

    if not os.environ.get("STREAMALLOC_CONFIG_LIBRARY") and _libraries.find(_config.LIBRARY_NAME) is None:
        pytest.skip("libstreamalloc_config.so is not built here (scripts/setup.sh or pip install . builds it)")
    # These tests read the options before the compiled extension loads; an
    # earlier test of the session may have loaded it, and then config()
    # reports the options it holds instead.
    monkeypatch.delitem(sys.modules, "streamalloc._C", raising=False)


def test_config_and_keys_need_no_torch(config_library, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    for variable in ("STREAMALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    keys = streamalloc.config_keys()
    names = [key for key, _ in keys]
    assert names[0] == "min_block_bytes" and "max_split_size_mb" in names and "stitch_slack" in names
    assert all(description for _, description in keys)
    text = streamalloc.config()
    assert [entry.split(":")[0] for entry in text.split(",")] == names
    assert "max_split_size_mb:unlimited" in text and "cross_stream_reuse:True" in text

    monkeypatch.setenv("STREAMALLOC_CONF", "max_split_size_mb:256, cross_stream_reuse:False")
    text = streamalloc.config()
    assert "max_split_size_mb:256" in text and "cross_stream_reuse:False" in text


def test_config_takes_the_keys_torchs_variable_shares_beneath_its_own(config_library, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF",
        "backend:native,max_split_size_mb:128,garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True",
    )
    monkeypatch.setenv("STREAMALLOC_CONF", "garbage_collection_threshold:0.7")
    text = streamalloc.config()
    assert "max_split_size_mb:128," in text and "garbage_collection_threshold:0.7," in text
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # set, so torch reads it and not the other
    assert "max_split_size_mb:unlimited," in streamalloc.config()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert "max_split_size_mb:64," in streamalloc.config()


def test_torchs_expandable_segments_cover_private_pools(config_library, monkeypatch):
    # torch's expandable segments reach its CUDA-graph and MemPool pools, so
    # its key sets streamalloc's expandable_private_pools too, beneath
    # STREAMALLOC_CONF.
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("STREAMALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert "expandable_segments:True,expandable_private_pools:False," in streamalloc.config()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments:True,expandable_private_pools:True," in streamalloc.config()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert "expandable_segments:False,expandable_private_pools:False," in streamalloc.config()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("STREAMALLOC_CONF", "expandable_private_pools:False")
    assert "expandable_segments:True,expandable_private_pools:False," in streamalloc.config()


def test_config_names_a_bad_key_without_torch(config_library, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setenv("STREAMALLOC_CONF", "max_split_size:256")
    with pytest.raises(ValueError, match=r"unknown key 'max_split_size'; valid keys: min_block_bytes"):
        streamalloc.config()
    monkeypatch.setenv("STREAMALLOC_CONF", "memory_fraction:2")
    with pytest.raises(ValueError, match="memory_fraction"):
        streamalloc.config()


def test_config_asks_the_loaded_extension(monkeypatch):
    # Once streamalloc._C is loaded (install() ran), the allocator's own settings answer.
    fake = types.ModuleType("streamalloc._C")
    fake.config = lambda: "from the extension"
    monkeypatch.setitem(sys.modules, "streamalloc._C", fake)
    assert streamalloc.config() == "from the extension"
