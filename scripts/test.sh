#!/usr/bin/env bash
# Sets up, builds and runs every CPU test: the Catch2 suites through ctest
# (unit tests on the simulated device; without a GPU ctest reports the
# [gpu] entry as skipped and the reason is printed), the sanitizer builds,
# a short libFuzzer run (when clang is there), a CMake install with the
# examples/cpp project built against it, the torch layer compiled against
# torch's headers (scripts/check-torch-layer.sh), and the Python tests
# (which skip with the reason without torch or a GPU). Exits non-zero on
# any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
failed=0

echo "== ctest (default build)"
ctest --test-dir build --output-on-failure -j "$(nproc)" || failed=1
# ctest shows no output for a skipped test; its reason is in the log.
grep -h '^streamalloc-skip:' build/Testing/Temporary/LastTest.log 2>/dev/null | sort -u | sed 's/^/  skipped, /' || true

echo "== ASan + UBSan: unit tests"
# Two processes, so that two cores share the run: the long randomized runs,
# and beside them the rest of "~[slow]" (the complement of the first spec).
if cmake --preset asan >/dev/null && cmake --build --preset asan -j "$(nproc)" --target unit_tests; then
  build-asan/bin/unit_tests "[randomized]~[expandable]~[slow]" >build-asan/unit-randomized.log 2>&1 &
  randomized=$!
  build-asan/bin/unit_tests "~[randomized]~[slow],[expandable]~[slow]" || failed=1
  wait $randomized || failed=1
  cat build-asan/unit-randomized.log
else
  failed=1
fi

echo "== TSan: multi-threaded tests"
# thread_tests: the test files that hold a [threads] test (tests/CMakeLists.txt).
cmake --preset tsan >/dev/null && cmake --build --preset tsan -j "$(nproc)" --target thread_tests &&
  TSAN_OPTIONS="halt_on_error=1" build-tsan/bin/thread_tests "[threads]" || failed=1

echo "== libFuzzer harnesses (clang): 20 s each"
scripts/fuzz.sh 20 || failed=1

echo "== cmake --install, then examples/cpp built against it with find_package(streamalloc)"
install_dir=$(mktemp -d)
if cmake --install build --prefix "$install_dir/prefix" >/dev/null &&
  cmake -S examples/cpp -B "$install_dir/example" -G Ninja -DCMAKE_PREFIX_PATH="$install_dir/prefix" >/dev/null &&
  cmake --build "$install_dir/example" >/dev/null; then
  "$install_dir/example/streamalloc_example" || failed=1
else
  failed=1
fi
rm -rf "$install_dir"

echo "== torch layer: python/src compiled against torch's headers (no GPU, nothing linked)"
scripts/check-torch-layer.sh || failed=1
# A newer torch whose headers need C++20 (the torch a fresh environment gets).
TORCH_SPEC='torch==2.15.*' TORCH_HEADERS_DIR="$PWD/build/torch-headers-2.15" scripts/check-torch-layer.sh || failed=1

echo "== pytest"
set +e
PYTHONPATH="$PWD/python" STREAMALLOC_REPLAY_BIN="$PWD/build/bin/streamalloc-replay" python3 -m pytest tests/python -rs -q
rc=$?
set -e
# 5 = nothing collected; every other non-zero code is a failure.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed=1; fi

if [ $failed -ne 0 ]; then
  echo "test.sh: FAILED"
  exit 1
fi
echo "test.sh: all passed"
