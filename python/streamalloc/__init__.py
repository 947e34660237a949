"""streamalloc: a block-caching CUDA memory allocator for PyTorch.

Install it at the top of a script, before the first CUDA tensor exists::

    import torch
    import streamalloc

    streamalloc.install()                      # or install(max_split_size_mb=512)

From then on torch allocates GPU memory through streamalloc, and
torch.cuda.memory_stats(), memory_summary(), empty_cache(),
Tensor.record_stream(), set_per_process_memory_fraction(),
torch.backends.cudnn.benchmark and CUDA graphs use and report streamalloc's
own state. Options come from STREAMALLOC_CONF (``key:value,...``) with
install()'s keyword arguments layered on top; config_keys() lists them.

Without torch, without a GPU or without the compiled extension the package
still imports, and config() and config_keys() work (they need only
libstreamalloc_config.so); the functions that need the rest raise
ImportError or RuntimeError saying what is missing. library_path() serves the plain
alternative, torch's own CUDAPluggableAllocator, which needs no extension.

Diagnosis (streamalloc.diagnosis): tag(), attribute() and report() say
which part of the program holds GPU memory, watch() flags what grows every
step, max_batch_size() finds the largest batch that fits, and
last_oom_report() explains the newest out-of-memory error.
"""

import os as _os
import re as _re
import sys as _sys

from . import _config, _libraries
from ._options import to_conf_string as _to_conf_string
from ._summary import format_summary as _format_summary
from . import diagnosis
from .diagnosis import (
    BatchSizeResult,
    LeakFinding,
    LeakWarning,
    attribute,
    disable_tagging,
    enable_tagging,
    last_oom_report,
    max_batch_size,
    report,
    tag,
    tagging_enabled,
    watch,
)
from .streams import PinnedPool, Prefetcher, to_device


def _read_version() -> str:
    """project(streamalloc VERSION ...) of CMakeLists.txt, the one place the
    version is written: read directly in a checkout, and from the
    _version.py the wheel build generates from it in an installed copy."""
    root = _libraries.source_root()
    if root is not None:
        with open(_os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
            match = _re.search(r"project\(streamalloc\s+VERSION\s+([0-9.]+)", f.read())
        if match:
            return match.group(1)
    try:
        from ._version import __version__ as version
    except ImportError:
        return "unknown"
    return version


__version__ = _read_version()
__all__ = diagnosis.__all__ + [
    "config",
    "config_keys",
    "empty_cache",
    "install",
    "is_installed",
    "library_path",
    "memory_summary",
    "reset_accumulated_stats",
    "reset_peak_stats",
    "snapshot",
    "stats",
    "PinnedPool",
    "Prefetcher",
    "to_device",
]

_LIBRARY_NAME = "libstreamalloc.so"
_INSTALL_HINT = (
    "call streamalloc.install() before any CUDA tensor is created, e.g. at the top of your script"
)


def _extension():
    """streamalloc._C, imported after torch: it links against torch's libraries."""
    try:
        import torch  # noqa: F401  (loads the libraries _C needs)
    except Exception as error:  # a broken torch install raises OSError too
        raise ImportError(
            f"streamalloc needs PyTorch with CUDA support, and `import torch` failed: {error}"
        ) from error
    try:
        from . import _C
    except ImportError as error:
        raise ImportError(
            "streamalloc's compiled extension streamalloc._C is missing from "
            f"{_libraries.PACKAGE_DIR}: this copy of the package was not built. "
            f"Install it from the source tree with `pip install .` ({error})"
        ) from error
    return _C


def _installed_extension():
    extension = _extension()
    if not extension.is_installed():
        raise RuntimeError(f"streamalloc is not torch's CUDA allocator yet: {_INSTALL_HINT}")
    return extension


def _device_index(device) -> int:
    """Index of `device` (an int, "cuda:1", torch.device or None for the
    current device)."""
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"streamalloc manages CUDA devices, not {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def _gpu_visible(torch) -> bool:
    """Whether torch can see a CUDA GPU, asked of NVML where it answers:
    torch.cuda.is_available() initialises the CUDA driver, after which a
    forked child can no longer use CUDA, and with torch's own allocator a
    program may fork before its first CUDA call."""
    if not torch.backends.cuda.is_built():
        return False
    count = torch.cuda._device_count_nvml()  # negative when NVML cannot answer
    return count > 0 if count >= 0 else torch.cuda.is_available()


def install(**config: object) -> None:
    """Makes streamalloc torch's CUDA allocator for this process.

    Keyword arguments are STREAMALLOC_CONF options (see config_keys()),
    layered on the STREAMALLOC_CONF environment variable, itself layered on
    the keys torch's PYTORCH_CUDA_ALLOC_CONF shares with streamalloc
    (max_split_size_mb, garbage_collection_threshold, ...): bools as
    True/False, numbers and strings as written, e.g.
    ``install(max_split_size_mb=256, cross_stream_reuse=False)``.

    It must run before torch initialises CUDA (before any CUDA tensor is
    created): torch cannot swap allocators afterwards, and install() then
    raises RuntimeError saying so. An unknown option or a bad value raises
    ValueError listing the valid keys.

    Calling install() again is harmless: it returns without effect. Options
    it passes still apply while no CUDA memory has been allocated; once
    streamalloc is in use, only options equal to those in force are
    accepted, and a request to change one raises RuntimeError.
    """
    extension = _extension()
    import torch

    if not _gpu_visible(torch):
        raise RuntimeError(
            "streamalloc.install(): torch sees no CUDA GPU (none visible to NVML or to the CUDA driver); "
            "streamalloc only manages GPU memory"
        )
    extension.install(_to_conf_string(config))


def is_installed() -> bool:
    """Whether torch's current CUDA allocator is streamalloc's. False when
    torch or the compiled extension is missing."""
    try:
        return bool(_extension().is_installed())
    except ImportError:
        return False


def stats(device=None) -> dict:
    """torch.cuda.memory_stats()'s keys, with the same meaning, for `device`
    (default: the current device), plus streamalloc's "fragmentation.*"
    metrics: largest_free_block_bytes, free_cached_bytes, external
    (1 - largest free block / free cached bytes) and reserved_allocated_ratio.
    """
    extension = _installed_extension()
    return extension.stats(_device_index(device))


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A readable table of stats(device), like torch.cuda.memory_summary(),
    ending with the fragmentation metrics."""
    extension = _installed_extension()
    index = _device_index(device)
    return _format_summary(extension.stats(index), index, abbreviated)


def snapshot(device=None) -> dict:
    """Segments and blocks in the layout of torch.cuda.memory._snapshot():
    {"segments": [...], "device_traces": [[], ...], "allocator_settings": {...}}.
    With `device` None it covers every device. Its traces are empty: the
    history recorded with torch.cuda.memory._record_memory_history() is in
    torch.cuda.memory._snapshot()["device_traces"]. While tagging is on
    (enable_tagging, tag, attribute), every allocated block has a "tag":
    its tag's name, or None when it was not recorded (sampling, or
    allocated before tagging began)."""
    extension = _installed_extension()
    return extension.snapshot(-1 if device is None else _device_index(device))


def empty_cache() -> None:
    """Returns every unused cached segment, on every device, to the driver."""
    _installed_extension().empty_cache()


def reset_peak_stats(device=None) -> None:
    """Sets every "peak" counter of `device` to its current value."""
    extension = _installed_extension()
    extension.reset_peak_stats(_device_index(device))


def reset_accumulated_stats(device=None) -> None:
    """Zeroes the "allocated"/"freed" totals of `device`."""
    extension = _installed_extension()
    extension.reset_accumulated_stats(_device_index(device))


def config() -> str:
    """The options in force (or those install() would use), in
    STREAMALLOC_CONF syntax, every key with its value. Needs neither torch
    nor a GPU: until the compiled extension is loaded nothing can have
    changed them, so they are STREAMALLOC_CONF over the keys torch's
    PYTORCH_CUDA_ALLOC_CONF (else PYTORCH_ALLOC_CONF) shares with
    streamalloc, over the defaults, parsed by the same C++ code. A bad
    value raises ValueError."""
    extension = _sys.modules.get(__name__ + "._C")
    if extension is not None:
        return extension.config()
    # torch 2.11's order: PYTORCH_CUDA_ALLOC_CONF when set at all, even empty.
    torch_settings = _os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if torch_settings is None:
        torch_settings = _os.environ.get("PYTORCH_ALLOC_CONF", "")
    return _config.resolve(_os.environ.get("STREAMALLOC_CONF", ""), torch_settings)


def config_keys() -> list:
    """(key, description) for every STREAMALLOC_CONF option, from the C++
    key table. Needs neither torch nor a GPU."""
    return [(key, description) for key, _default, description in _config.key_table()]


def library_path() -> str:
    """Path of libstreamalloc.so, for torch's plain pluggable-allocator path
    (no compiled extension involved)::

        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            streamalloc.library_path(), "streamalloc_malloc", "streamalloc_free")
        torch.cuda.memory.change_current_allocator(allocator)

    The one shipped in this package; from a source checkout, the one
    scripts/setup.sh built (build/lib/, or build-gpu/lib/). That path only
    allocates and frees: torch's memory statistics, snapshot,
    cudnn.benchmark and record_stream need install() instead.
    """
    path = _libraries.find(_LIBRARY_NAME)
    if path is None:
        raise RuntimeError(_libraries.missing_message(_LIBRARY_NAME, "needs the CUDA toolkit to build"))
    return path
