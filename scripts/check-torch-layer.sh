#!/usr/bin/env bash
# Compiles the torch layer (python/src/*.cpp) against torch's headers
# without building or linking it (g++ -fsyntax-only with the project's
# warning flags and -Werror), so that a machine with neither a GPU nor an
# importable torch still catches a compile error there. The headers come
# from the installed torch, or else (and always when TORCH_SPEC is set)
# from torch's wheel on PyPI (TORCH_SPEC, default torch==2.11.*, the torch
# the GPU checks run), fetched once into TORCH_HEADERS_DIR (default
# build/torch-headers). The C++ standard is the one torch's CMake config
# asks for (the highest cxx_std_NN it names, else C++17), read by
# python/torch_cxx_standard.py as for python/torch.cmake's build. Needs
# scripts/setup.sh's build (its generated version header). Prints "skipped: <reason>" and exits 0 when the headers,
# Python's or the CUDA toolkit's cannot be had; exits 1 on a compile error.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
  echo "check-torch-layer: skipped: $*"
  exit 0
}

cache_dir="${TORCH_HEADERS_DIR:-$PWD/build/torch-headers}"
torch_root=""
if [ -z "${TORCH_SPEC:-}" ]; then
  # Where python/torch.cmake looks when torch cannot be imported.
  torch_root=$(python3 - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("torch")
if spec and spec.submodule_search_locations:
    root = list(spec.submodule_search_locations)[0]
    if os.path.isdir(os.path.join(root, "include")):
        print(root)
PY
)
fi
if [ -z "$torch_root" ]; then
  torch_root="$cache_dir/torch"
  if [ ! -d "$torch_root/include" ]; then
    spec="${TORCH_SPEC:-torch==2.11.*}"
    download=$(mktemp -d)
    echo "check-torch-layer: fetching the headers of $spec from PyPI"
    python3 -m pip download -q --no-deps --only-binary=:all: "$spec" -d "$download" >/dev/null 2>&1 ||
      { rm -rf "$download"; skip "pip could not download $spec"; }
    mkdir -p "$cache_dir"
    python3 - "$download" "$cache_dir" <<'PY' || { rm -rf "$download" "$cache_dir"; skip "the downloaded wheel has no headers"; }
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/torch-*.whl")[0]
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist()
               if m.startswith("torch/include/") or m == "torch/share/cmake/Torch/TorchConfig.cmake"]
    if not any(m.startswith("torch/include/") for m in members):
        sys.exit(1)
    archive.extractall(sys.argv[2], members)
PY
    rm -rf "$download"
  fi
fi
torch_include="$torch_root/include"
standard=c++$(python3 python/torch_cxx_standard.py "$torch_root")

python_include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ ! -f "$python_include/Python.h" ]; then
  echo "check-torch-layer: installing Python's headers (python3-dev)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-dev >/dev/null; } ||
    skip "Python.h is missing and python3-dev could not be installed"
  [ -f "$python_include/Python.h" ] || skip "no Python.h under $python_include"
fi

cuda_include=""
if command -v nvcc >/dev/null; then cuda_include="$(dirname "$(command -v nvcc)")/../include"; fi
[ -n "$cuda_include" ] && [ -f "$cuda_include/cuda_runtime_api.h" ] || cuda_include=/usr/local/cuda/include
[ -f "$cuda_include/cuda_runtime_api.h" ] || skip "no CUDA toolkit headers"
[ -f build/generated/include/streamalloc/version.hpp ] || { echo "check-torch-layer: run scripts/setup.sh first"; exit 1; }

# The warnings of the streamalloc_warnings target (CMakeLists.txt): keep the two alike.
flags=(-std=$standard -fsyntax-only -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Werror
  -isystem "$torch_include" -isystem "$torch_include/torch/csrc/api/include" -isystem "$python_include"
  -isystem "$cuda_include" -Iallocator/include -Ibuild/generated/include -Istreams/include -Ipython/src)
echo "check-torch-layer: python/src/*.cpp against $torch_include ($standard)"
# One g++ per file, as many at once as there are cores.
if printf '%s\n' python/src/*.cpp | xargs -d '\n' -n 1 -P "$(nproc)" g++ "${flags[@]}"; then
  echo "check-torch-layer: every file compiles"
else
  echo "check-torch-layer: a file does not compile (g++'s errors above name it)"
  exit 1
fi
