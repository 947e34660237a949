#!/usr/bin/env bash
# Installs what the CPU build and tests need (Debian packages, PyPI
# packages) when it is missing, then configures and builds the default
# preset into build/. Safe to run again: it installs nothing twice.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
[ -f /usr/include/zlib.h ] || need_apt+=(zlib1g-dev)
[ -f /usr/include/catch2/catch.hpp ] || [ -f /usr/include/catch2/catch_all.hpp ] || need_apt+=(catch2)
# clang and its runtime (libFuzzer, sanitizers) for scripts/fuzz.sh
if command -v clang++ >/dev/null; then
  [ -f "$(clang++ -print-runtime-dir 2>/dev/null)/libclang_rt.fuzzer-x86_64.a" ] || need_apt+=(libclang-rt-dev)
else
  need_apt+=(clang libclang-rt-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if ! python3 -c "import pytest" 2>/dev/null; then
  echo "setup: installing pytest"
  python3 -m pip install -q pytest 2>/dev/null ||
    python3 -m pip install -q --break-system-packages pytest 2>/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pytest >/dev/null; }
fi

cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
