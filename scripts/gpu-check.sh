#!/usr/bin/env bash
# The whole GPU verification, run on a machine with a CUDA GPU and torch (the
# lent H200), never by CI: environment, CUDA+torch build, unit ctest, the
# [gpu] Catch2 tests, pip install of the Python package, pytest, and the
# GPU benchmarks when scripts/gpu-bench.sh exists. Every step is timed and
# logged; a failed step does not stop the later ones; the exit status is
# non-zero when any step failed.
#
#   scripts/gpu-check.sh [step...]     steps: env build unit gpu stage pip venv pytest sanitizer bench
#   scripts/gpu-check.sh --multi-gpu [step...]
#
# --multi-gpu (on a machine with 2+ GPUs, e.g. the lent nvidia-h200-x2) adds
# the `multigpu` step, tests/python/test_multi_gpu.py, to the named steps
# (none by default), with the build and pip steps first when the pip step's
# install is missing and pip is not named (`--multi-gpu pip` installs
# without the full build). It exports the variables that keep NVLink multicast
# off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1), which the lent multi-GPU machines require.
#
# Environment: PYTHON (default python3), JOBS (default 16), BUILD_DIR
# (default <repo>/build-gpu), OUT (when set, the combined log and summary go
# there; per-step logs always go to BUILD_DIR/logs), PYTEST_TARGETS (the
# pytest step's files or folders, relative to the repository; default
# tests/python; a long suite can be split over several calls this way),
# PYTEST_K (a pytest -k expression for that step, spaces allowed).
#
# The steps run through scripts/lib/steps.sh, the step runner gpu-bench.sh
# also uses. Sourced rather than run, this file only defines the settings
# above and the step functions (gpu-bench.sh's `build` step runs step_build
# and step_pip that way).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

# shellcheck source-path=SCRIPTDIR source=lib/steps.sh
source "$repo_root/scripts/lib/steps.sh"

python_bin="${PYTHON:-python3}"
jobs="${JOBS:-16}"
build_dir="${BUILD_DIR:-$repo_root/build-gpu}"
step_log_dir="$build_dir/logs"
report_dir="${OUT:-$step_log_dir}"
site_dir="$build_dir/pip-target"
all_steps=(env build unit gpu stage pip venv pytest sanitizer bench)
# `stage` lays the package out from the build step's outputs (no second
# compile); `pip` builds and installs it the way users do. Either provides
# the package the later steps import; by default both run, pip last.
# `venv` is the user's path: `pip install .` with build isolation into a fresh
# virtual environment that sees only torch (WHEEL_DIR: a folder of the build
# requirements' wheels for a machine without network, see step_venv).

step_env() {
  nvidia-smi
  "$python_bin" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "cxx11 abi", torch.compiled_with_cxx11_abi())
assert torch.cuda.is_available(), "torch does not see a GPU"
for i in range(torch.cuda.device_count()):
    print(f"device {i}: {torch.cuda.get_device_name(i)}")
PY
  cmake --version
  ninja --version
  if command -v nvcc >/dev/null; then nvcc --version; fi
}

step_build() {
  local torch_prefix pybind11_dir
  torch_prefix=$("$python_bin" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  pybind11_dir=$("$python_bin" -m pybind11 --cmakedir)
  cmake -S "$repo_root" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSTREAMALLOC_CUDA=ON \
    -DSTREAMALLOC_TESTS=ON \
    -DSTREAMALLOC_BENCH=ON \
    -DSTREAMALLOC_TORCH=ON \
    -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -Dpybind11_DIR="$pybind11_dir" \
    -DPython_EXECUTABLE="$(command -v "$python_bin")"
  ninja -C "$build_dir" -j"$jobs"
}

step_unit() {
  ctest --test-dir "$build_dir" --output-on-failure --timeout 600 -E '^(unit_slow|unit_slow_replay|gpu)$'
}

step_gpu() {
  local log="$step_log_dir/gpu_tests.out"
  "$build_dir/bin/gpu_tests" "[gpu]" --durations yes 2>&1 | tee "$log"
  # On a GPU machine a skip for lack of a GPU means the tests proved nothing.
  if grep -q "skipped: no GPU" "$log"; then
    echo "gpu-check: [gpu] tests skipped for lack of a GPU on a GPU machine" >&2
    return 1
  fi
}

step_pip() {
  test -f "$repo_root/pyproject.toml" || { echo "gpu-check: no pyproject.toml" >&2; return 1; }
  rm -rf "$site_dir"
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$python_bin" -m pip install -v --no-build-isolation --no-deps --no-index \
    --target "$site_dir" \
    --config-settings=build-dir="$build_dir/skbuild" \
    --config-settings=cmake.define.STREAMALLOC_TESTS=OFF \
    --config-settings=cmake.define.STREAMALLOC_BENCH=OFF \
    "$repo_root"
}

# A fresh virtual environment whose only package is the torch this machine
# has (linked in by a .pth file, as a user's venv would hold it), a copy of
# the tree without build outputs, and `pip install .` with build isolation:
# pip fetches scikit-build-core, cmake and ninja itself. Without network,
# WHEEL_DIR (default <repo>/.whl when it exists) is where pip finds them.
step_venv() {
  local venv="$build_dir/fresh-venv" src="$build_dir/fresh-src" torch_site venv_site
  local wheel_dir="${WHEEL_DIR:-$repo_root/.whl}" index_args=()
  rm -rf "$venv" "$src"
  mkdir -p "$src"
  tar -C "$repo_root" --exclude='./build*' --exclude=./.whl --exclude=./.pt_tests --exclude=./.git -cf - . |
    tar -C "$src" -xf -
  "$python_bin" -m venv "$venv"
  torch_site=$("$python_bin" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$torch_site" >"$venv_site/torch_site.pth"
  if [[ -d $wheel_dir ]]; then index_args=(--no-index --find-links "$wheel_dir"); fi
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$venv/bin/python" -m pip install "${index_args[@]}" "$src"
  cd /
  "$venv/bin/python" - <<'PY'
import streamalloc, torch
streamalloc.install()
x = torch.ones(1 << 20, device="cuda")
stats = torch.cuda.memory_stats()
assert stats["allocated_bytes.all.current"] >= 4 << 20, stats["allocated_bytes.all.current"]
assert streamalloc.is_installed()
print("fresh venv: streamalloc", streamalloc.__version__, "from", streamalloc.__file__,
      "allocated", stats["allocated_bytes.all.current"])
PY
}

step_stage() {
  rm -rf "$site_dir"
  mkdir -p "$site_dir/streamalloc"
  cp "$repo_root"/python/streamalloc/*.py "$site_dir/streamalloc/"
  cp "$build_dir"/lib/_C*.so "$build_dir"/lib/libstreamalloc.so "$build_dir"/lib/libstreamalloc_config.so \
    "$site_dir/streamalloc/"
  # The version an installed copy reads (the wheel build writes the same file).
  local version
  version=$(sed -n 's/^project(streamalloc VERSION \([0-9.]*\).*/\1/p' "$repo_root/CMakeLists.txt")
  echo "__version__ = \"$version\"" >"$site_dir/streamalloc/_version.py"
}

step_pytest() {
  local log="$step_log_dir/pytest.out" style=()
  test -d "$site_dir" || { echo "gpu-check: the pip step did not install the package" >&2; return 1; }
  # Each test's time on its own line as it ends (pytest 9+), so a run cut
  # short by a time limit still shows where the time went.
  if "$python_bin" -c 'import sys, pytest; sys.exit(pytest.version_tuple < (9, 0))' 2>/dev/null; then
    style=(-o console_output_style=times)
  fi
  PYTHONPATH="$site_dir${PYTHONPATH:+:$PYTHONPATH}" \
    STREAMALLOC_COUNTING_ALLOCATOR="$build_dir/lib/libcounting_allocator.so" \
    STREAMALLOC_REPLAY_BIN="$build_dir/bin/streamalloc-replay" \
    "$python_bin" -m pytest ${PYTEST_TARGETS:-tests/python} ${PYTEST_K:+-k "$PYTEST_K"} -v -rs "${style[@]}" --durations=20 2>&1 | tee "$log"
  # A run where everything skipped proves nothing on a GPU machine.
  grep -Eq '[0-9]+ passed' "$log" || { echo "gpu-check: pytest passed no test" >&2; return 1; }
}

# The record_stream scenario (a tensor freed while a side-stream kernel still
# uses it) under compute-sanitizer's memcheck: any invalid device access by
# the kernels that run on recycled memory fails the step.
step_sanitizer() {
  export PATH="$PATH:/usr/local/cuda/bin"
  command -v compute-sanitizer || { echo "gpu-check: compute-sanitizer is not on PATH or in /usr/local/cuda/bin" >&2; return 1; }
  test -d "$site_dir" || { echo "gpu-check: the pip step did not install the package" >&2; return 1; }
  cd "$repo_root/tests/python/scripts"
  PYTHONPATH="$site_dir${PYTHONPATH:+:$PYTHONPATH}" timeout 150 \
    compute-sanitizer --tool memcheck --error-exitcode 97 --print-limit 20 "$python_bin" streams.py
}

step_bench() {
  BUILD_DIR="$build_dir" PYTHON="$python_bin" bash "$repo_root/scripts/gpu-bench.sh"
}

# DDP over NCCL, all-reduce buffer safety and two devices in one process
# (tests/python/test_multi_gpu.py). A skip there means the step proved
# nothing, so it counts as a failure.
step_multigpu() {
  local log="$step_log_dir/multigpu.out" count
  test -d "$site_dir" || { echo "gpu-check: the pip step did not install the package" >&2; return 1; }
  count=$("$python_bin" -c 'import torch; print(torch.cuda.device_count())') ||
    { echo "gpu-check: could not ask torch how many GPUs it sees" >&2; return 1; }
  if [[ $count -lt 2 ]]; then
    echo "gpu-check: --multi-gpu needs at least 2 GPUs; torch sees $count (run it on nvidia-h200-x2)" >&2
    return 1
  fi
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  PYTHONPATH="$site_dir${PYTHONPATH:+:$PYTHONPATH}" "$python_bin" -m pytest "$repo_root/tests/python/test_multi_gpu.py" \
    -v -rs 2>&1 | tee "$log"
  grep -Eq '[0-9]+ passed' "$log" || { echo "gpu-check: the multi-GPU tests passed nothing" >&2; return 1; }
  if grep -Eq '[0-9]+ skipped' "$log"; then
    echo "gpu-check: multi-GPU tests skipped on a multi-GPU run" >&2
    return 1
  fi
}

# Sourced (`return` works only there): the settings and step functions only.
if (return 0 2>/dev/null); then return 0; fi

multi_gpu=0
named_steps=()
for arg in "$@"; do
  case $arg in
    --multi-gpu) multi_gpu=1 ;;
    -*) echo "gpu-check: unknown option '$arg' (options: --multi-gpu)" >&2; exit 2 ;;
    *) named_steps+=("$arg") ;;
  esac
done
# The combined log and summary: REPORT_DIR/gpu-check.log and
# REPORT_DIR/gpu-check-summary.txt.
steps_init gpu-check "$step_log_dir" "$report_dir" "${all_steps[@]}" -- "${named_steps[@]}"
if [[ ${#named_steps[@]} -eq 0 && $multi_gpu -eq 1 ]]; then
  steps_selected=()
fi
if [[ $multi_gpu -eq 1 ]]; then
  # The multi-GPU tests import the package the pip step installs; a run
  # that names pip itself installs it without the full build.
  if [[ ! -d "$site_dir/streamalloc" && " ${steps_selected[*]-} " != *" pip "* ]]; then
    steps_selected+=(build pip)
  fi
  steps_selected+=(multigpu)
fi

steps_run env step_env
steps_run build step_build
steps_run unit step_unit
steps_run gpu step_gpu
steps_run stage step_stage
steps_run pip step_pip
steps_run venv step_venv
steps_run pytest step_pytest
steps_run sanitizer step_sanitizer
if [[ -f "$repo_root/scripts/gpu-bench.sh" ]]; then
  steps_run bench step_bench
else
  steps_record bench SKIP 0.0
fi
if steps_is_selected multigpu; then
  steps_run multigpu step_multigpu
fi

steps_finish
