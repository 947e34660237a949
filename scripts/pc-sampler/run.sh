#!/usr/bin/env bash
# Usage: scripts/pc-sampler/run.sh REPORT COMMAND [ARGS...]
# Runs COMMAND with pc_sampler preloaded (PC_SAMPLER_US, default 200 us of
# wall time per sample and thread) and writes the samples summed by
# function to REPORT. For machines without perf; needs g++ and addr2line.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 REPORT COMMAND [ARGS...]" >&2
  exit 2
fi
report=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
g++ -O2 -shared -fPIC -o "$work/libpc_sampler.so" "$here/pc_sampler.cpp" -ldl -lrt
status=0
PC_SAMPLER_OUT="$work/samples.txt" LD_PRELOAD="$work/libpc_sampler.so" "$@" || status=$?
python3 "$here/report.py" "$work/samples.txt" > "$report"
exit $status
