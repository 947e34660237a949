#!/usr/bin/env bash
# The whole benchmark on a GPU machine: streamalloc-bench (every allocator in
# one process), bench/python_bench.py (four allocator modes, a process each),
# bench/streams_bench.py, bench/ipc_bench.py, captures of three traces (GPT-2
# training with varying length, GPT-2 generation, ResNet-50 at a fixed
# batch), replay of every trace through torch's allocators and streamalloc
# (default settings and plain segments), and the memory plot. Prints the
# markdown tables last.
#
#   scripts/gpu-bench.sh [STEP ...]
#
# Steps, run in this order whatever the order named (default: all):
#   microbench python_bench streams_bench ipc_bench capture replay plot
# On an H200 microbench, python_bench, streams_bench and capture took about
# 4 minutes together in the last run (plus about a minute to build on a bare
# machine); replay and plot should take about 2 (not yet timed with three
# traces); bench/ipc_bench.py took 105 s with --count 60 (the step runs
# 200, not yet timed as a step; 64 s as a step with BENCH_QUICK's 20);
# no step's time limit is over 480 s.
# What the steps write stays in BUILD_DIR/bench-work between invocations: a
# step replaces only what it produces itself, and replay reads the traces
# that the last `capture` left there. So
#   scripts/gpu-bench.sh microbench python_bench streams_bench capture
#   scripts/gpu-bench.sh replay plot
# gives, after the second call, the same results.md as one full run.
#
# Writes to OUT (at most 4 files), from what the work area holds: results.md
# (every table there, when each step last ran, the command and the machine;
# rewritten after every step), replay_memory.png (reserved vs allocated over
# each replayed trace), bench-logs.tar.gz (logs, JSON, timelines) and
# bench-traces.tar.gz (the captured traces).
#
# Environment: PYTHON (default python3); BUILD_DIR (default <repo>/build-gpu,
# built with scripts/gpu-check.sh's build and pip steps when its binaries or
# its pip-target are missing); OUT (default BUILD_DIR/bench-out);
# STREAMALLOC_TRACES (more traces to replay: files or directories of
# *.trace.csv[.gz], colon-separated; default bench/traces and ../shared/traces
# where they exist); BENCH_QUICK=1 (tiny counts: checks the pipeline, not
# the numbers); BENCH_TIME_LIMIT_S (seconds for this invocation: each step's
# limit is cut to what is left less 30 s, and a step with under 10 s left is
# not started). A failed step does not stop the later ones; the exit status
# is non-zero when any step of this invocation failed or was not started.
#
# The steps run through scripts/lib/steps.sh, the step runner gpu-check.sh
# also uses: each step's log is BUILD_DIR/bench-work/logs/STEP.log; this
# invocation's combined log and summary table are gpu-bench.log and
# gpu-bench-summary.txt in BUILD_DIR/bench-work (and in bench-logs.tar.gz).
# The `build` step runs gpu-check.sh's step_build and step_pip, sourced
# from it.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 2
# shellcheck source-path=SCRIPTDIR source=lib/steps.sh
source "$repo_root/scripts/lib/steps.sh"

all_steps=(microbench python_bench streams_bench ipc_bench capture replay plot)
command_line="scripts/gpu-bench.sh${*:+ $*}"

python_bin="${PYTHON:-python3}"
build_dir="${BUILD_DIR:-$repo_root/build-gpu}"
out_dir="${OUT:-$build_dir/bench-out}"
work="$build_dir/bench-work"
quick="${BENCH_QUICK:-0}"
time_limit="${BENCH_TIME_LIMIT_S:-0}"
bin="$build_dir/bin"

# Rejects an unknown step name (exit 2); the steps named, or all of them,
# run in the order of all_steps.
steps_init gpu-bench "$work/logs" "$work" "${all_steps[@]}" -- "$@"
# status/NAME holds "result<TAB>seconds<TAB>when" of step NAME's last run.
mkdir -p "$work/status" "$work/traces" "$out_dir"

# may_start DEFAULT_S: sets `limit` to DEFAULT_S, cut by BENCH_TIME_LIMIT_S
# to what is left less 30 s (the kill grace and the outputs); fails when
# under 10 s would be left.
may_start() {
  limit=$1
  if [[ $time_limit -gt 0 ]]; then
    local left=$((time_limit - SECONDS - 30))
    [[ $left -lt $limit ]] && limit=$left
  fi
  [[ $limit -ge 10 ]]
}

# not_started NAME: records that NAME was not started for lack of time. Its
# status and outputs from an earlier run stay as they were.
not_started() {
  steps_log "=== gpu-bench step '$1': not started (BENCH_TIME_LIMIT_S=$time_limit reached)"
  steps_record "$1" "NOT STARTED" 0.0
}

# recorded NAME RESULT DETAIL SECONDS (the runner's hook, after every
# outcome): the step's status for results.md (its result line's wording,
# seconds, when), unless it was not started, and results.md rewritten.
# shellcheck disable=SC2317 # called by the runner through steps_record_hook
recorded() {
  local name=$1 result=$2 detail=$3 seconds=$4 when
  if [[ $result != "NOT STARTED" ]]; then
    when="$(date -u '+%Y-%m-%d %H:%M UTC')$([[ $quick == 1 ]] && echo ', BENCH_QUICK')"
    printf '%s\t%s\t%s\n' "$detail" "$seconds" "$when" >"$work/status/$name"
  fi
  write_results
}
steps_record_hook=recorded

# step NAME LIMIT_S COMMAND...: runs COMMAND through the runner with a time
# limit, its output (stdout and stderr) to the terminal and to
# logs/NAME.log.
step() {
  local name=$1 step_limit=$2
  shift 2
  steps_step --limit "$step_limit" "$name" "$@"
}

# markdown STEP LIMIT_S COMMAND...: a step whose stdout is its markdown
# table, kept as STEP.md (its log also gets stderr).
markdown() {
  local name=$1 step_limit=$2
  shift 2
  step "$name" "$step_limit" bash -c '"$0" "$@" > "'"$work/$name"'.md"; rc=$?; cat "'"$work/$name"'.md"; exit $rc' "$@"
}

# table_step NAME DEFAULT_S COMMAND...: when NAME is selected, its last
# table and JSON removed and COMMAND run as a markdown step within
# may_start's limit; recorded as not started when no time is left.
table_step() {
  local name=$1 default_limit=$2
  shift 2
  steps_is_selected "$name" || return 0
  if may_start "$default_limit"; then
    rm -f "$work/$name.md" "$work/$name.json"
    markdown "$name" "$limit" "$@"
  else
    not_started "$name"
  fi
}

gpu_line="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
torch_line="$("$python_bin" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
source_line="$(git -C "$repo_root" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata')"
if git -C "$repo_root" status --porcelain 2>/dev/null | grep -q .; then
  source_line+=" (uncommitted changes)"
fi
# results.md from what the work area holds, copied to OUT with the plot.
write_results() {
  local results="$work/results.md" name status i not_run=()
  for i in "${!steps_names[@]}"; do
    [[ ${steps_results[$i]} == "NOT STARTED" ]] && not_run+=("${steps_names[$i]}")
  done
  {
    echo "# streamalloc GPU benchmark results"
    echo
    echo "- written: $(date -u '+%Y-%m-%d %H:%M UTC'); host $(hostname)"
    echo "- GPU: $gpu_line"
    echo "- torch: $torch_line"
    echo "- source: $source_line"
    echo "- command: \`$command_line\` (BUILD_DIR=$build_dir$([[ $quick == 1 ]] && echo ', BENCH_QUICK=1'))"
    echo "- each table below comes from its step's last run in this BUILD_DIR, which may be an earlier invocation: see 'ran'"
    if [[ ${#not_run[@]} -gt 0 ]]; then
      echo "- not started by this command (BENCH_TIME_LIMIT_S=$time_limit reached): ${not_run[*]}"
    fi
    if [[ -s $work/replay-traces.txt ]]; then
      echo "- traces replayed: $(cat "$work/replay-traces.txt")"
    fi
    echo
    echo "| step | result | seconds | ran |"
    echo "|---|---|---|---|"
    for name in build machine microbench python_bench streams_bench ipc_bench capture_gpt2_train capture_gpt2_generate capture_resnet50_fixed replay plot; do
      if [[ -f $work/status/$name ]]; then
        IFS=$'\t' read -r -a status <"$work/status/$name"
        echo "| $name | ${status[0]} | ${status[1]} | ${status[2]} |"
      fi
    done
    for name in microbench python_bench streams_bench ipc_bench replay; do
      if [[ -s $work/$name.md ]]; then
        echo
        cat "$work/$name.md"
      fi
    done
  } >"$results"
  cp "$results" "$out_dir/results.md"
  if [[ -f $work/replay_memory.png ]]; then
    cp "$work/replay_memory.png" "$out_dir/replay_memory.png"
  else
    rm -f "$out_dir/replay_memory.png"
  fi
}

# torch's native allocator is what every "native" figure means, and
# streamalloc's defaults what every "streamalloc" one means: no allocator
# settings leak in from the caller's environment.
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF STREAMALLOC_CONF

if steps_is_selected microbench || steps_is_selected python_bench || steps_is_selected streams_bench ||
  steps_is_selected ipc_bench || steps_is_selected replay; then
  if [[ ! -x $bin/streamalloc-bench || ! -x $bin/streamalloc-replay || ! -d $build_dir/pip-target ]]; then
    if may_start 480; then
      # gpu-check.sh's build and pip steps: its step functions, sourced in a
      # shell of their own (a time limit needs a command), each run with -e
      # and -x as gpu-check.sh runs them, pip even when the build failed.
      # shellcheck disable=SC2016 # "$1" is the inner shell's
      step build "$limit" env BUILD_DIR="$build_dir" PYTHON="$python_bin" \
        bash -c 'source "$1"; steps_call step_build step_pip' gpu-bench-build "$repo_root/scripts/gpu-check.sh"
    else
      not_started build
    fi
  fi
fi
if [[ -d $build_dir/pip-target ]]; then
  export PYTHONPATH="$build_dir/pip-target${PYTHONPATH:+:$PYTHONPATH}"
fi

if may_start 60; then
  step machine "$limit" bash -c "nvidia-smi; '$python_bin' -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)'"
else
  not_started machine
fi

micro_args=()
python_args=()
ipc_args=()
train_args=()
generate_args=()
resnet_args=()
if [[ $quick == 1 ]]; then
  micro_args=(--reps 3 --pairs 2000 --thread-pairs 500 --mixed-steps 8000)
  python_args=(--quick)
  ipc_args=(--count 20 --warmup 2)
  train_args=(--steps 4)
  generate_args=(--requests 3 --new-tokens 8)
  resnet_args=(--steps 3)
fi

table_step microbench 300 "$bin/streamalloc-bench" --json "$work/microbench.json" "${micro_args[@]}"
# Three rounds of four worker processes, at most 100 s each (about 20 s
# each on an H200).
table_step python_bench 540 "$python_bin" bench/python_bench.py --timeout 100 --json "$work/python_bench.json" \
  "${python_args[@]}"
table_step streams_bench 180 "$python_bin" bench/streams_bench.py --json "$work/streams_bench.json"
# Four modes, a receiver and a sender process per size each.
table_step ipc_bench 240 "$python_bin" bench/ipc_bench.py --timeout 120 --json "$work/ipc_bench.json" "${ipc_args[@]}"

if steps_is_selected capture; then
  for workload in gpt2_train gpt2_generate resnet50_fixed; do
    case $workload in
      gpt2_train) trace=gpt2_train_varlen script=gpt2_train_varlen workload_args=("${train_args[@]}") ;;
      gpt2_generate) trace=gpt2_generate script=gpt2_generate workload_args=("${generate_args[@]}") ;;
      resnet50_fixed) trace=resnet50_fixed_batch script=resnet50_train_fixed workload_args=("${resnet_args[@]}") ;;
    esac
    if may_start 180; then
      rm -f "$work/traces/$trace.trace.csv.gz"
      step "capture_$workload" "$limit" "$python_bin" scripts/capture_trace.py -o "$work/traces/$trace.trace.csv.gz" \
        -- "bench/workloads/$script.py" "${workload_args[@]}"
    else
      not_started "capture_$workload"
    fi
  done
fi

if steps_is_selected replay; then
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

  if ! may_start 480; then
    not_started replay
  else
    rm -rf "$work/timelines" "$work/replay.md" "$work/replay.json" "$work/replay-traces.txt"
    mkdir -p "$work/timelines"
    if [[ ${#traces[@]} -gt 0 ]]; then
      echo "${traces[*]##*/}" >"$work/replay-traces.txt"
      # replay_torch stops starting replays in time to print what it has.
      markdown replay "$limit" "$python_bin" bench/replay_torch.py --streamalloc-replay "$bin/streamalloc-replay" \
        --time-limit $((limit > 60 ? limit - 30 : limit / 2)) --timeline-dir "$work/timelines" \
        --json "$work/replay.json" "${traces[@]}"
    else
      echo "gpu-bench: no trace to replay (no capture here and no STREAMALLOC_TRACES / bench/traces)" >&2
      steps_record replay FAIL 0.0 "FAIL (no trace)"
    fi
  fi
fi

if steps_is_selected plot; then
  if may_start 120; then
    rm -f "$work/replay_memory.png"
    step plot "$limit" "$python_bin" scripts/plot_replay.py -o "$work/replay_memory.png" --timeline-dir "$work/timelines"
  else
    not_started plot
  fi
fi

write_results
# The summary table (also in bench-work, hence in bench-logs.tar.gz).
steps_finish
bench_status=$?
tar -czf "$out_dir/bench-logs.tar.gz" -C "$work" --exclude=./traces --exclude=./replay_memory.png .
tar -czf "$out_dir/bench-traces.tar.gz" -C "$work" traces
for archive in "$out_dir/bench-logs.tar.gz" "$out_dir/bench-traces.tar.gz"; do
  if [[ $(stat -c %s "$archive") -gt $((16 * 1024 * 1024)) ]]; then
    echo "gpu-bench: warning: $archive is over 16 MiB and will not come back from the device" >&2
  fi
done

echo
echo "=== gpu-bench results (also in $out_dir/results.md)"
cat "$work/results.md"

[[ $bench_status -eq 0 ]] || exit 1
exit 0
