"""scripts/torch-suite/run.sh, which runs PyTorch's own test files under
each allocator, checked against stand-in `torch` and `streamalloc`
packages (no torch or GPU needed): a test file newer than the installed
torch imports names it lacks, also in the children it spawns; each mode
tells torch's test utilities whether its allocator expands."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "scripts" / "torch-suite" / "run.sh"

FAKE_TORCH = {
    "torch/__init__.py": """
        from . import cuda, version
        __version__ = "0.0+stand-in"
    """,
    "torch/version.py": "cuda = None\n",
    "torch/cuda/__init__.py": "from . import memory\n",
    "torch/cuda/memory.py": "def get_allocator_backend():\n    return 'native'\n",
    "torch/testing/__init__.py": "",
    "torch/testing/_internal/__init__.py": "",
    "torch/testing/_internal/common_utils.py": """
        import unittest
        import expecttest
        class TestCase(expecttest.TestCase):
            pass
        def run_tests():
            unittest.main()
    """,
}

# Imports four names common_utils lacks and a module torch lacks; a spawned
# child unpickles `child`, so it imports this module too. A missing
# decorator factory skips the test it decorates, not the module.
TEST_FILE = """
    import multiprocessing
    from torch.testing._internal.common_utils import (TestCase, TEST_NEWER, newer_helper, skipIfNewer,
                                                       newer_library_context)
    from torch.testing._internal.common_newer import TEST_NEWER_MODULE

    def child(queue):
        queue.put((TEST_NEWER, TEST_NEWER_MODULE))

    class TestNewer(TestCase):
        @skipIfNewer
        def test_a_spawned_child_imports_this_module(self):
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            self.assertEqual(queue.get(timeout=60), (False, False))
            process.join(60)
            self.assertEqual(process.exitcode, 0)

        def test_a_missing_helper_skips(self):
            newer_helper()

        @newer_library_context("cublas")
        def test_a_missing_decorator_factory_skips(self):
            raise AssertionError("a test under a missing decorator factory ran")
"""


def make_tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def run_suite(tmp_path, *args, env=None):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake"), "PYTHON": sys.executable,
           "SUITE_TIMEOUT": "300", "STREAMALLOC_PACKAGE_DIR": str(tmp_path / "fake"), **(env or {})}
    return subprocess.run([str(RUN), *args], capture_output=True, text=True, env=env, timeout=360)


def test_a_newer_test_file_runs_with_stand_ins_in_every_process(tmp_path):
    make_tree(tmp_path / "fake", FAKE_TORCH)
    test_file = tmp_path / "test_newer.py"
    test_file.write_text(textwrap.dedent(TEST_FILE))
    out = tmp_path / "out"
    result = run_suite(tmp_path, "native", str(test_file), str(out))
    log = (out / "native.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 skipped" in log, log
    assert "test_a_missing_decorator_factory_skips SKIPPED" in log, log
    assert "newer_helper is missing from this torch's torch.testing._internal" in log, log
    stand_ins = next(line for line in log.splitlines() if line.startswith("torch-suite: stand-ins:"))
    for expected in ("common_utils.TEST_NEWER (flag)", "common_utils.newer_helper (raises SkipTest)",
                     "common_utils.newer_library_context (raises SkipTest)",
                     "common_utils.skipIfNewer (identity decorator)", "common_newer.<module> (empty module)",
                     "common_newer.TEST_NEWER_MODULE (flag)"):
        assert expected in stand_ins, stand_ins
    assert "torch-suite: mode native, torch 0.0+stand-in" in log, log


FAKE_STREAMALLOC = {
    "streamalloc/__init__.py": """
        installed_with = None
        def install(**kwargs):
            global installed_with
            installed_with = kwargs
        def is_installed():
            return installed_with is not None
    """,
}

# Writes what its process saw: the variable and how streamalloc was installed.
MODE_REPORT_FILE = """
    import json, os
    import streamalloc
    from torch.testing._internal.common_utils import TestCase

    class TestMode(TestCase):
        def test_report(self):
            with open(os.environ["MODE_REPORT"], "w") as f:
                json.dump({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                           "installed_with": streamalloc.installed_with}, f)
"""


@pytest.mark.parametrize("mode, conf, installed_with", [
    ("native", None, None),
    ("native_expandable", "expandable_segments:True", None),
    ("streamalloc", "expandable_segments:True", {}),
    ("streamalloc_plain", None, {"expandable_segments": False}),
])
def test_each_mode_tells_torch_whether_its_allocator_expands(tmp_path, mode, conf, installed_with):
    make_tree(tmp_path / "fake", {**FAKE_TORCH, **FAKE_STREAMALLOC})
    test_file = tmp_path / "test_mode.py"
    test_file.write_text(textwrap.dedent(MODE_REPORT_FILE))
    report = tmp_path / "report.json"
    result = run_suite(tmp_path, mode, str(test_file), str(tmp_path / "out"), env={"MODE_REPORT": str(report)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(report.read_text()) == {"conf": conf, "installed_with": installed_with}
    assert f"PYTORCH_CUDA_ALLOC_CONF={conf or '(unset)'}" in (tmp_path / "out" / f"{mode}.log").read_text()


def test_an_unknown_mode_or_a_missing_file_is_refused(tmp_path):
    bad_mode = run_suite(tmp_path, "cudaMallocAsync", str(tmp_path / "x.py"), str(tmp_path / "out"))
    assert bad_mode.returncode == 2 and "MODE must be native, native_expandable, streamalloc or" in bad_mode.stderr
    missing = run_suite(tmp_path, "native", str(tmp_path / "absent.py"), str(tmp_path / "out"))
    assert missing.returncode == 2 and "no test file" in missing.stderr


def load_expecttest_stand_in():
    spec = importlib.util.spec_from_file_location("expecttest_stand_in", RUN.parent / "fallback" / "expecttest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_expecttest_stand_in_compares_inline_expectations():
    case = load_expecttest_stand_in().TestCase()
    case.assertExpectedInline("x:  T0\ny:  T1", "x:  T0\ny:  T1")
    case.assertExpectedInline("bad size\nException raised from f at a.cpp:1", "bad size")
    for actual, expect in (("x:  T0\ny:  T2", "x:  T0\ny:  T1"), ("x:  T0", "x:  T0\n"),
                           ("bad size, and more", "bad size")):
        with pytest.raises(AssertionError):
            case.assertExpectedInline(actual, expect)

    def raises():
        raise ValueError("bad size")

    case.assertExpectedRaisesInline(ValueError, raises, "bad size")
    with pytest.raises(AssertionError):
        case.assertExpectedRaisesInline(ValueError, raises, "good size")
    with pytest.raises(AssertionError):
        case.assertExpectedRaisesInline(ValueError, lambda: None, "bad size")


NATIVE_LOG = """\
torch-suite: mode native, torch 2.11.0
test_x.py::TestA::test_same PASSED                                       [ 20%]
test_x.py::TestA::test_flips PASSED                                      [ 40%]
test_x.py::TestA::test_skip SKIPPED (needs two GPUs)                     [ 60%]
test_x.py::TestA::test_param[a b] FAILED                                 [ 80%]
test_x.py::TestA::test_teardown PASSED                                   [100%]
test_x.py::TestA::test_teardown ERROR                                    [100%]
FAILED test_x.py::TestA::test_param[a b] - AssertionError: an ERROR line
"""
STREAMALLOC_LOG = """\
torch-suite: mode streamalloc, torch 2.11.0
test_x.py::TestA::test_same PASSED                                       [ 17%]
test_x.py::TestA::test_flips FAILED                                      [ 33%]
test_x.py::TestA::test_skip SKIPPED (needs two GPUs)                     [ 50%]
test_x.py::TestA::test_param[a b] FAILED                                 [ 67%]
test_x.py::TestA::test_teardown PASSED                                   [ 83%]
test_x.py::TestA::test_new PASSED                                        [100%]
"""


def run_compare(*paths):
    return subprocess.run([sys.executable, str(RUN.parent / "compare.py"), *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


def test_compare_lists_the_tests_whose_outcomes_differ(tmp_path):
    native, streamalloc = tmp_path / "native.log", tmp_path / "streamalloc.log"
    native.write_text(NATIVE_LOG)
    streamalloc.write_text(STREAMALLOC_LOG)
    result = run_compare(native, streamalloc)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{native}: 2 passed, 1 failed, 1 error, 1 skipped (5 tests)"
    assert lines[1] == f"{streamalloc}: 3 passed, 2 failed, 1 skipped (6 tests)"
    assert lines[2:] == [
        "differs: test_x.py::TestA::test_flips: PASSED / FAILED",
        "differs: test_x.py::TestA::test_new: not run / PASSED",
        "differs: test_x.py::TestA::test_teardown: ERROR / PASSED",
        "3 of 6 tests differ",
    ]
    same = run_compare(native, native)
    assert same.returncode == 0 and same.stdout.splitlines()[-1] == "every outcome the same"


def test_compare_refuses_a_log_without_outcomes(tmp_path):
    native, empty = tmp_path / "native.log", tmp_path / "empty.log"
    native.write_text(NATIVE_LOG)
    empty.write_text("torch-suite: stopped after 600 s (SUITE_TIMEOUT)\n")
    result = run_compare(native, empty)
    assert result.returncode == 2 and "no test outcomes in" in result.stderr
    missing = run_compare(native, tmp_path / "absent.log")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
