"""Runs at the start of every Python process of a torch-suite run (run.sh
puts this folder first on PYTHONPATH, and spawned children inherit it).

STREAMALLOC_SUITE_MODE: "streamalloc" installs streamalloc with its
defaults, "streamalloc_plain" with expandable_segments=False, "native" and
"native_expandable" leave torch's allocator (run.sh sets the variable that
makes the second use expandable segments). STREAMALLOC_SUITE_TEST_FILE:
the test file whose missing torch.testing._internal names get stand-ins,
in whichever process imports it. A sitecustomize this one shadows still
runs.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as error:  # the allocator below must be selected all the same
        print(f"torch-suite: {spec.origin} failed: {error!r}", file=sys.stderr)


# The modes that keep torch's allocator, and streamalloc.install()'s
# arguments for the others (conftest.py reads these too).
NATIVE_MODES = ("native", "native_expandable")
STREAMALLOC_MODES = {"streamalloc": {}, "streamalloc_plain": {"expandable_segments": False}}


def _select_allocator(mode):
    if mode in NATIVE_MODES:
        return
    if mode not in STREAMALLOC_MODES:
        sys.exit(f"torch-suite: unknown STREAMALLOC_SUITE_MODE {mode!r} "
                 f"({', '.join((*NATIVE_MODES, *STREAMALLOC_MODES))})")
    import streamalloc

    streamalloc.install(**STREAMALLOC_MODES[mode])


_run_shadowed_sitecustomize()
if "STREAMALLOC_SUITE_MODE" in os.environ:
    if os.environ.get("STREAMALLOC_SUITE_TEST_FILE"):
        import torch_suite_standins

        torch_suite_standins.install_hook(os.environ["STREAMALLOC_SUITE_TEST_FILE"])
    _select_allocator(os.environ["STREAMALLOC_SUITE_MODE"])
