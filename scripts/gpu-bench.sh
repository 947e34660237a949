#!/usr/bin/env bash
# The whole benchmark on a GPU machine in one command: streamalloc-bench
# (every allocator in one process), bench/python_bench.py (four allocator
# modes, a process each), captures of the two GPT-2 traces, replay of every
# trace through torch's allocators and streamalloc, and the memory plot.
# Prints the markdown tables last; about 5 minutes on an H200.
#
#   scripts/gpu-bench.sh
#
# Writes to OUT (at most 4 files): results.md (every table, the command and
# the machine), replay_memory.png (reserved vs allocated over each replayed
# trace), bench-logs.tar.gz (logs, JSON, timelines) and bench-traces.tar.gz
# (the traces captured here).
#
# Environment: PYTHON (default python3); BUILD_DIR (default <repo>/build-gpu,
# built with scripts/gpu-check.sh's build and pip steps when its binaries or
# its pip-target are missing); OUT (default BUILD_DIR/bench-out);
# STREAMALLOC_TRACES (more traces to replay: files or directories of
# *.trace.csv[.gz], colon-separated; default bench/traces and ../shared/traces
# where they exist); BENCH_QUICK=1 (tiny counts: checks the pipeline, not
# the numbers). A failed step does not stop the later ones; the exit status
# is non-zero when any step failed.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

python_bin="${PYTHON:-python3}"
build_dir="${BUILD_DIR:-$repo_root/build-gpu}"
out_dir="${OUT:-$build_dir/bench-out}"
work="$build_dir/bench-work"
quick="${BENCH_QUICK:-0}"
bin="$build_dir/bin"

rm -rf "$work"
mkdir -p "$work/logs" "$work/traces" "$work/timelines" "$out_dir"

step_names=()
step_results=()
step_seconds=()
now_ns() { date +%s%N; }

# step NAME TIMEOUT_S COMMAND...: runs COMMAND with a time limit, its output
# (stdout and stderr) to the terminal and to logs/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== gpu-bench step '$name' ($(date -u +%H:%M:%S) UTC): $*"
  local start rc
  start=$(now_ns)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$work/logs/$name.log"
  rc=${PIPESTATUS[0]}
  local ms=$(( ($(now_ns) - start) / 1000000 ))
  local seconds
  seconds=$(printf '%d.%d' $((ms / 1000)) $(((ms % 1000) / 100)))
  step_names+=("$name")
  step_seconds+=("$seconds")
  if [[ $rc -eq 0 ]]; then
    step_results+=(PASS)
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    step_results+=("TIMEOUT (${limit}s)")
  else
    step_results+=("FAIL (exit $rc)")
  fi
  echo "=== gpu-bench step '$name': ${step_results[-1]} in ${seconds}s"
}

# torch's native allocator is what every "native" figure means: no
# allocator settings leak in from the caller's environment.
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF

if [[ ! -x $bin/streamalloc-bench || ! -x $bin/streamalloc-replay || ! -d $build_dir/pip-target ]]; then
  step build 1200 env OUT= BUILD_DIR="$build_dir" PYTHON="$python_bin" bash "$repo_root/scripts/gpu-check.sh" build pip
fi
if [[ -d $build_dir/pip-target ]]; then
  export PYTHONPATH="$build_dir/pip-target${PYTHONPATH:+:$PYTHONPATH}"
fi

step machine 60 bash -c "nvidia-smi; '$python_bin' -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)'"

micro_args=()
python_args=()
train_args=()
generate_args=()
if [[ $quick == 1 ]]; then
  micro_args=(--reps 3 --pairs 2000 --thread-pairs 500 --mixed-steps 8000)
  python_args=(--quick)
  train_args=(--steps 4)
  generate_args=(--requests 3 --new-tokens 8)
fi

step microbench 300 bash -c '"$0" "$@" > "'"$work"'/microbench.md"; rc=$?; cat "'"$work"'/microbench.md"; exit $rc' \
  "$bin/streamalloc-bench" --json "$work/microbench.json" "${micro_args[@]}"

step python_bench 660 bash -c '"$0" "$@" > "'"$work"'/python_bench.md"; rc=$?; cat "'"$work"'/python_bench.md"; exit $rc' \
  "$python_bin" bench/python_bench.py --timeout 160 --json "$work/python_bench.json" "${python_args[@]}"

step streams_bench 180 bash -c '"$0" "$@" > "'"$work"'/streams_bench.md"; rc=$?; cat "'"$work"'/streams_bench.md"; exit $rc' \
  "$python_bin" bench/streams_bench.py --json "$work/streams_bench.json"

step capture_gpt2_train 180 "$python_bin" scripts/capture_trace.py -o "$work/traces/gpt2_train_varlen.trace.csv.gz" \
  -- bench/workloads/gpt2_train_varlen.py "${train_args[@]}"
step capture_gpt2_generate 180 "$python_bin" scripts/capture_trace.py -o "$work/traces/gpt2_generate.trace.csv.gz" \
  -- bench/workloads/gpt2_generate.py "${generate_args[@]}"

traces=()
for captured in "$work"/traces/*.trace.csv.gz; do
  [[ -f $captured ]] && traces+=("$captured")
done
if [[ -n ${STREAMALLOC_TRACES:-} ]]; then
  IFS=: read -r -a trace_sources <<<"$STREAMALLOC_TRACES"
else
  trace_sources=("$repo_root/bench/traces" "$repo_root/../shared/traces")
fi
for source in "${trace_sources[@]}"; do
  if [[ -d $source ]]; then
    for file in "$source"/*.trace.csv "$source"/*.trace.csv.gz; do
      [[ -f $file ]] && traces+=("$file")
    done
  elif [[ -f $source ]]; then
    traces+=("$source")
  elif [[ -n ${STREAMALLOC_TRACES:-} ]]; then
    echo "gpu-bench: STREAMALLOC_TRACES names '$source', which does not exist" >&2
  fi
done

if [[ ${#traces[@]} -gt 0 ]]; then
  step replay 900 bash -c '"$0" "$@" > "'"$work"'/replay.md"; rc=$?; cat "'"$work"'/replay.md"; exit $rc' \
    "$python_bin" bench/replay_torch.py --streamalloc-replay "$bin/streamalloc-replay" \
    --timeline-dir "$work/timelines" --json "$work/replay.json" "${traces[@]}"
  step plot 120 "$python_bin" scripts/plot_replay.py -o "$out_dir/replay_memory.png" --timeline-dir "$work/timelines"
else
  echo "gpu-bench: no trace to replay (captures failed and no STREAMALLOC_TRACES / bench/traces)" >&2
  step_names+=(replay) step_results+=("FAIL (no trace)") step_seconds+=(0.0)
fi

results="$work/results.md"
{
  echo "# streamalloc GPU benchmark results"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); host $(hostname)"
  echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- torch: $("$python_bin" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "- source: $(git -C "$repo_root" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata') "\
"$(git -C "$repo_root" status --porcelain 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
  echo "- command: \`scripts/gpu-bench.sh\` (BUILD_DIR=$build_dir$([[ $quick == 1 ]] && echo ', BENCH_QUICK=1'))"
  echo "- traces replayed: ${traces[*]##*/}"
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
  for i in "${!step_names[@]}"; do
    echo "| ${step_names[$i]} | ${step_results[$i]} | ${step_seconds[$i]} |"
  done
  for part in microbench python_bench streams_bench replay; do
    if [[ -s $work/$part.md ]]; then
      echo
      cat "$work/$part.md"
    fi
  done
} >"$results"
cp "$results" "$out_dir/results.md"

tar -czf "$out_dir/bench-logs.tar.gz" -C "$work" --exclude=./traces .
tar -czf "$out_dir/bench-traces.tar.gz" -C "$work" traces
for archive in "$out_dir/bench-logs.tar.gz" "$out_dir/bench-traces.tar.gz"; do
  if [[ $(stat -c %s "$archive") -gt $((16 * 1024 * 1024)) ]]; then
    echo "gpu-bench: warning: $archive is over 16 MiB and will not come back from the device" >&2
  fi
done

echo
echo "=== gpu-bench results (also in $out_dir/results.md)"
cat "$results"

for result in "${step_results[@]}"; do
  [[ $result == PASS ]] || exit 1
done
exit 0
