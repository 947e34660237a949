"""pytest side of a torch-suite run (run.sh copies this file beside the
test file): the stand-ins, a header naming the allocator, the stand-ins'
list at the end, and a stop when the run asked for streamalloc but
streamalloc is not torch's allocator in the pytest process."""

import os

import pytest

import sitecustomize  # site/sitecustomize.py (first on PYTHONPATH, run at start-up): the modes
import torch_suite_standins

MODE = os.environ.get("STREAMALLOC_SUITE_MODE", "native")
# Before collection imports the test file (pytest's import hook would
# answer before sitecustomize's).
torch_suite_standins.patch_missing(os.environ["STREAMALLOC_SUITE_TEST_FILE"])


def pytest_configure(config):
    if MODE not in sitecustomize.STREAMALLOC_MODES:
        return
    import streamalloc

    if not streamalloc.is_installed():
        pytest.exit(f"torch-suite: mode {MODE} but streamalloc is not torch's allocator here", returncode=3)


def pytest_report_header(config):
    import torch

    return (f"torch-suite: mode {MODE}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"allocator backend {torch.cuda.memory.get_allocator_backend()}, "
            f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}")


def pytest_terminal_summary(terminalreporter):
    stand_ins = torch_suite_standins.STAND_INS
    terminalreporter.write_line(
        "torch-suite: stand-ins: "
        + (", ".join(f"{module}.{name} ({kind})" for module, name, kind in stand_ins) if stand_ins else "none")
    )
