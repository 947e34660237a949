"""The version of the checkout these scripts belong to, for their
--version: project(streamalloc VERSION ...) of CMakeLists.txt, the one place
it is written (streamalloc.__version__ and the CLIs' version.hpp read it
too). Read as text, so the scripts need not import the package."""

import os
import re

_CMAKELISTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "CMakeLists.txt")


def version() -> str:
    try:
        with open(_CMAKELISTS, encoding="utf-8") as f:
            match = re.search(r"project\(streamalloc\s+VERSION\s+([0-9.]+)", f.read())
    except OSError:
        match = None
    return match.group(1) if match else "unknown"
