#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (ASan + UBSan, build-fuzz/) and
# runs each for the given number of seconds (default 20), starting from the
# seeds in fuzz/corpus/<name>/ plus what earlier runs found (kept in
# build-fuzz/corpus/<name>/). Exits non-zero when a harness finds a crash;
# the input is left in build-fuzz/artifacts/. Skips when clang is missing.
#   scripts/fuzz.sh [seconds] [harness...]
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-20}"
shift || true
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(fuzz_config fuzz_trace fuzz_allocator_ops)

if ! command -v clang++ >/dev/null || ! command -v clang >/dev/null; then
  echo "fuzz: skipped: clang/clang++ not found (libFuzzer needs clang)"
  exit 0
fi

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTREAMALLOC_FUZZ=ON \
  -DSTREAMALLOC_CUDA=OFF -DSTREAMALLOC_TESTS=OFF -DSTREAMALLOC_BENCH=OFF -DSTREAMALLOC_WERROR=ON >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${harnesses[@]}"

mkdir -p build-fuzz/artifacts
failed=0
for h in "${harnesses[@]}"; do
  mkdir -p "build-fuzz/corpus/$h"
  echo "fuzz: $h for ${seconds}s (corpus build-fuzz/corpus/$h, seeds fuzz/corpus/$h)"
  log="build-fuzz/$h.log"
  if "build-fuzz/bin/$h" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/ \
    "build-fuzz/corpus/$h" "fuzz/corpus/$h" >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    added=$(sed -n 's/^stat::new_units_added: *//p' "$log")
    echo "fuzz: $h ok: ${runs:-?} inputs run, ${added:-?} new corpus entries, no crash"
  else
    failed=1
    echo "fuzz: $h FAILED (full log: $log):"
    grep -E "^fuzz_|ERROR|SUMMARY|Test unit written|^    #[0-9]+ " "$log" | head -40
  fi
done
exit $failed
