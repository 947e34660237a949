"""Where streamalloc's shared libraries are: in the installed package, or,
when the package is used from a source checkout (``PYTHONPATH=python``), in
the build directories scripts/setup.sh and scripts/gpu-check.sh write."""

import os
from typing import List, Optional

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.dirname(os.path.dirname(PACKAGE_DIR))
# scripts/setup.sh builds build/, scripts/gpu-check.sh build-gpu/.
_BUILD_DIRS = ("build", "build-gpu")


def source_root() -> Optional[str]:
    """The checkout this package directory belongs to (``<root>/python/streamalloc``),
    or None for an installed copy."""
    in_checkout = os.path.basename(os.path.dirname(PACKAGE_DIR)) == "python" and os.path.isfile(
        os.path.join(_SOURCE_ROOT, "CMakeLists.txt")
    )
    return _SOURCE_ROOT if in_checkout else None


def candidates(name: str) -> List[str]:
    """Paths where library `name` may be, in the order they are tried."""
    paths = [os.path.join(PACKAGE_DIR, name)]
    root = source_root()
    if root is not None:
        paths += [os.path.join(root, build, "lib", name) for build in _BUILD_DIRS]
    return paths


def find(name: str) -> Optional[str]:
    return next((path for path in candidates(name) if os.path.isfile(path)), None)


def missing_message(name: str, needs: str) -> str:
    hint = (
        "build it with scripts/setup.sh (in this checkout), or install the package with `pip install .`"
        if source_root() is not None
        else "this copy of the package was not built; install it from the source tree with `pip install .`"
    )
    return f"{name} ({needs}) is not in {', '.join(os.path.dirname(p) for p in candidates(name))}: {hint}"
