#!/usr/bin/env bash
# Sets up, builds and runs every CPU test: the Catch2 suites through ctest
# (unit tests on the simulated device; [gpu] tests skip visibly without a
# GPU), the sanitizer builds, a short libFuzzer run (when clang is there)
# and the Python tests (which skip visibly without torch or a GPU). Exits
# non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
failed=0

echo "== ctest (default build)"
ctest --test-dir build --output-on-failure || failed=1

echo "== ASan + UBSan: unit tests"
cmake --preset asan >/dev/null && cmake --build --preset asan -j "$(nproc)" --target unit_tests &&
  build-asan/bin/unit_tests "~[slow]" || failed=1

echo "== TSan: multi-threaded tests"
cmake --preset tsan >/dev/null && cmake --build --preset tsan -j "$(nproc)" --target unit_tests &&
  TSAN_OPTIONS="halt_on_error=1" build-tsan/bin/unit_tests "[threads]" || failed=1

echo "== libFuzzer harnesses (clang): 20 s each"
scripts/fuzz.sh 20 || failed=1

echo "== pytest"
set +e
PYTHONPATH="$PWD/python" python3 -m pytest tests/python -rs -q
rc=$?
set -e
# 5 = nothing collected; every other non-zero code is a failure.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed=1; fi

if [ $failed -ne 0 ]; then
  echo "test.sh: FAILED"
  exit 1
fi
echo "test.sh: all passed"
