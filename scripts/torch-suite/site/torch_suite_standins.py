"""Stand-ins for names a PyTorch test file imports from
torch.testing._internal that the installed torch lacks (the test file may
be newer than the torch it runs against).

`patch_missing(test_file)` looks up the names the file imports from
torch.testing._internal and sets each missing one to a harmless stand-in;
`install_hook(test_file)` does it lazily, when a process (a spawned child
unpickling one of the file's functions) first imports the test module.
Every stand-in set is listed in STAND_INS.
"""

import ast
import importlib
import os
import sys
import types
import unittest

_INTERNAL = "torch.testing._internal"

# (module, name, kind) of every stand-in set in this process.
STAND_INS = []
_patched = False

_DECORATOR_PREFIXES = (
    "skip", "only", "slow", "serial", "dtypes", "parametrize", "with", "disable",
    "expectedFailure", "xfail", "large", "requires", "deprecate", "tf32",
    "precision", "toleranceOverride", "ops",
)


def internal_imports(path):
    """{module: [names]} of the file's `from torch.testing._internal... import` lines."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    wanted = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level != 0 or not node.module:
            continue
        if node.module != _INTERNAL and not node.module.startswith(_INTERNAL + "."):
            continue
        names = wanted.setdefault(node.module, [])
        names.extend(a.name for a in node.names if a.name != "*" and a.name not in names)
    return wanted


def _any_decorator(*args, **kwargs):
    """Identity decorator, bare (@deco) or with arguments (@deco(...))."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda target: target


def stand_in(name):
    """(value, kind) standing in for a missing name."""
    if name == "TestCase":
        return unittest.TestCase, "unittest.TestCase"
    if name == "run_tests":
        return (lambda *a, **k: unittest.main()), "unittest.main"
    if name.isupper():
        if name.startswith("TEST_WITH_"):  # torch reads these from PYTORCH_TEST_WITH_*
            return os.getenv("PYTORCH_" + name, "0") == "1", "environment flag"
        return {"IS_LINUX": sys.platform.startswith("linux"), "IS_MACOS": sys.platform == "darwin",
                "IS_WINDOWS": sys.platform == "win32"}.get(name, False), "flag"
    if name.startswith(_DECORATOR_PREFIXES):
        return _any_decorator, "identity decorator"

    reason = f"{name} is missing from this torch's {_INTERNAL}"

    def missing(*args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "<module>" or "__qualname__" in caller.f_locals:
            # Called where the file defines its tests, as a decorator factory
            # (`@helper("x")` on a test): skip what it decorates, not the
            # whole module.
            return unittest.skip(reason)
        raise unittest.SkipTest(reason)

    missing.__name__ = name
    return missing, "raises SkipTest"


def _module_or_empty(module_name):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # a dependency is missing: that is worth seeing as it is
        empty = types.ModuleType(module_name)
        sys.modules[module_name] = empty
        parent, _, child = module_name.rpartition(".")
        setattr(importlib.import_module(parent), child, empty)
        STAND_INS.append((module_name, "<module>", "empty module"))
        return empty


def patch_missing(test_file):
    """Sets the stand-ins now (once per process)."""
    global _patched
    if _patched:
        return
    _patched = True
    for module_name, names in internal_imports(test_file).items():
        module = _module_or_empty(module_name)
        for name in names:
            if not hasattr(module, name):
                value, kind = stand_in(name)
                setattr(module, name, value)
                STAND_INS.append((module_name, name, kind))


class _PatchBeforeImport:
    """A meta-path entry that patches just before the test module is
    imported and finds nothing itself. (pytest's own import hook comes
    first in its process, so conftest.py patches there.)"""

    def __init__(self, test_file):
        self.test_file = test_file
        self.module_name = os.path.splitext(os.path.basename(test_file))[0]

    def find_spec(self, name, path=None, target=None):
        if name == self.module_name:
            patch_missing(self.test_file)
        return None


def install_hook(test_file):
    sys.meta_path.insert(0, _PatchBeforeImport(test_file))
