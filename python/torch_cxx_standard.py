"""Prints the C++ standard torch's own CMake config asks of code that uses
its headers: the highest cxx_std_NN that TorchConfig.cmake names under the
torch root given as the argument, else 17. python/torch.cmake and
scripts/check-torch-layer.sh both ask it."""

import os
import re
import sys


def cxx_standard(root: str) -> int:
    config = os.path.join(root, "share", "cmake", "Torch", "TorchConfig.cmake")
    try:
        with open(config) as f:
            named = [int(n) for n in re.findall(r"cxx_std_(\d+)", f.read())]
    except OSError:
        named = []
    return max(named + [17])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torch_cxx_standard.py TORCH_ROOT")
    print(cxx_standard(sys.argv[1]))
