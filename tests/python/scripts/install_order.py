"""When install() may be called, one scenario per process (argv[1]):

too_late    CUDA memory is in use before install(): it must refuse with a
            RuntimeError naming the fix, and torch keeps working natively.
twice       install() again is harmless; options may change until CUDA is
            used, afterwards only a request that changes nothing passes.
bad_option  an unknown option is a ValueError listing the valid keys and
            changes nothing; GPU functions before install() say to install.
torch_variable  torch's allocator variable (PYTORCH_CUDA_ALLOC_CONF, set by
            the test with STREAMALLOC_CONF) at installation; argv[2], when
            given, is install()'s options as a JSON object.
"""

import json
import sys
import warnings

import torch

import streamalloc
from _common import emit


def outcome(call):
    """None when call() returns, else the exception's type and message."""
    try:
        call()
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error)}
    return None


scenario = sys.argv[1]
result = {"scenario": scenario}

if scenario == "too_late":
    early = torch.zeros(1024, device="cuda")
    result["install"] = outcome(streamalloc.install)
    result["is_installed"] = streamalloc.is_installed()
    result["backend"] = torch.cuda.memory.get_allocator_backend()
    result["computed_after"] = (torch.ones(4, device="cuda") + early[:4]).sum().item()
elif scenario == "twice":
    result["first"] = outcome(streamalloc.install)
    result["second"] = outcome(streamalloc.install)
    result["option_before_use"] = outcome(lambda: streamalloc.install(max_split_size_mb=256))
    tensor = torch.ones(1 << 20, device="cuda")
    result["again_after_use"] = outcome(streamalloc.install)
    result["same_option_after_use"] = outcome(lambda: streamalloc.install(max_split_size_mb=256))
    result["changed_option_after_use"] = outcome(lambda: streamalloc.install(max_split_size_mb=512))
    result["config"] = streamalloc.config()
    result["max_split_size"] = streamalloc.stats()["max_split_size"]
    result["is_installed"] = streamalloc.is_installed()
    result["backend"] = torch.cuda.memory.get_allocator_backend()
    result["computed_after"] = tensor.sum().item()
elif scenario == "bad_option":
    result["stats_before_install"] = outcome(streamalloc.stats)
    result["bad_option"] = outcome(lambda: streamalloc.install(no_such_option=1))
    result["bad_value"] = outcome(lambda: streamalloc.install(max_split_size_mb="lots"))
    result["keys"] = [key for key, _ in streamalloc.config_keys()]
    result["install"] = outcome(streamalloc.install)
    result["is_installed"] = streamalloc.is_installed()
    result["computed_after"] = torch.ones(8, device="cuda").sum().item()
elif scenario == "torch_variable":
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["install"] = outcome(lambda: streamalloc.install(**options))
    result["warnings"] = [str(w.message) for w in caught]
    tensor = torch.ones(1 << 20, device="cuda")
    result["config"] = streamalloc.config()
    result["max_split_size"] = streamalloc.stats()["max_split_size"]
    result["torch_stats_max_split_size"] = torch.cuda.memory_stats()["max_split_size"]
    result["computed_after"] = tensor.sum().item()
else:
    sys.exit(f"unknown scenario {scenario!r}")
emit(result)
