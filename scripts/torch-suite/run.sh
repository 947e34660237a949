#!/usr/bin/env bash
# Runs one of PyTorch's own test files (an uncommitted copy, e.g.
# test/test_cuda.py or test/test_multiprocessing.py of a PyTorch checkout)
# under one allocator, in every process the tests start:
#
#   scripts/torch-suite/run.sh MODE TEST_FILE OUT_DIR [pytest args...]
#
# MODE: native, native_expandable (torch's allocator with
# expandable_segments:True), streamalloc (its defaults, which use expandable
# segments) or streamalloc_plain (expandable_segments=False). PyTorch's test
# utilities read PYTORCH_CUDA_ALLOC_CONF to know whether the allocator uses
# expandable segments (newer test files check in every tearDown that the
# snapshot's settings say the same), so native_expandable and streamalloc
# run with it set to expandable_segments:True unless the caller set it:
# compare streamalloc with native_expandable, streamalloc_plain with
# native. The file is copied to OUT_DIR/MODE/ beside
# this folder's conftest.py, so the repository's pytest settings do not
# apply; the log is OUT_DIR/MODE.log; the exit status is pytest's (124 when
# SUITE_TIMEOUT ran out). Names the test file imports from
# torch.testing._internal that the installed torch lacks get stand-ins
# (listed at the end of the log), and expecttest gets one when missing.
# compare.py, beside this file, lists the tests whose outcomes differ
# between two modes' logs.
#
# Environment: PYTHON (default python3), SUITE_TIMEOUT (seconds, default
# 600), STREAMALLOC_PACKAGE_DIR (where `import streamalloc` is found;
# default build-gpu/pip-target, what scripts/gpu-check.sh's stage and pip
# steps make). PYTORCH_TEST_WITH_SLOW=1 enables torch's slow tests.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "usage: $0 MODE TEST_FILE OUT_DIR [pytest args...]" >&2
  exit 2
fi
mode=$1 test_file=$2 out_dir=$3
shift 3
case $mode in
  native | streamalloc_plain) ;;
  native_expandable | streamalloc) export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" ;;
  *) echo "torch-suite: MODE must be native, native_expandable, streamalloc or streamalloc_plain, not '$mode'" >&2; exit 2 ;;
esac
[[ -f $test_file ]] || { echo "torch-suite: no test file '$test_file'" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$here/../.." && pwd)"
package_dir="${STREAMALLOC_PACKAGE_DIR:-$repo_root/build-gpu/pip-target}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"
work="$out_dir/$mode"
rm -rf "$work"
mkdir -p "$work"
cp "$test_file" "$here/conftest.py" "$work/"
printf '[pytest]\n' >"$work/pytest.ini"

STREAMALLOC_SUITE_TEST_FILE="$work/$(basename "$test_file")"
export STREAMALLOC_SUITE_MODE="$mode" STREAMALLOC_SUITE_TEST_FILE
export PYTHONPATH="$here/site:$package_dir${PYTHONPATH:+:$PYTHONPATH}:$here/fallback"
cd "$work"
status=0
timeout --kill-after=10 "${SUITE_TIMEOUT:-600}" "${PYTHON:-python3}" -m pytest "$(basename "$test_file")" \
  -p no:cacheprovider -v -rs --durations=10 "$@" 2>&1 | tee "$out_dir/$mode.log" || status=${PIPESTATUS[0]}
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "torch-suite: stopped after ${SUITE_TIMEOUT:-600} s (SUITE_TIMEOUT)" | tee -a "$out_dir/$mode.log"
fi
exit "$status"
