# shellcheck shell=bash
# The step runner of scripts/gpu-check.sh and scripts/gpu-bench.sh, sourced
# by both (not run on its own).
#
# A script names its steps, lets its caller pick some of them by name, and
# runs each through steps_run or steps_step. Every step is timed, its output
# goes to the terminal, to STEP_LOG_DIR/NAME.log and to the combined log
# REPORT_DIR/PREFIX.log between a start line and a result line:
#   === PREFIX step 'NAME' (HH:MM:SS UTC[, limit Ss])[: COMMAND]
#   === PREFIX step 'NAME': PASS|FAIL (exit N)|TIMEOUT (Ss) in S.Ds
# A failed step does not stop the later ones; steps_finish prints the
# summary table (also written to REPORT_DIR/PREFIX-summary.txt and appended
# to the combined log) and fails when any step failed, timed out or was not
# started.
#
#   steps_init PREFIX STEP_LOG_DIR REPORT_DIR KNOWN_STEP... -- NAMED_STEP...
#       rejects a named step that is not a known one (exit 2, before any file
#       is touched); selects the named steps, or every known one when none
#       is named (steps_selected, an array the script may change); creates
#       both directories and empties the combined log.
#   steps_is_selected NAME
#   steps_run NAME FUNCTION          steps_step when NAME is selected, else a SKIP
#   steps_step [--limit S] NAME FUNCTION|COMMAND...
#       A shell function runs in a subshell with -e and -x (steps_call); a
#       command runs as it is, under `timeout --kill-after=10 S` with --limit
#       (exit 124 or 137 is then a TIMEOUT). A time limit needs a command.
#   steps_call FUNCTION...           each function in a subshell with -e and
#       -x, all of them even when one fails; its status is the first failed
#       one's (0 when none failed). Call it
#       as a statement of its own (not in an `if` test or on the left of || or
#       &&, where bash ignores -e in the functions).
#   steps_record NAME RESULT SECONDS [DETAIL]
#       records an outcome the runner did not run (SKIP, NOT STARTED, FAIL)
#   steps_log LINE                   a line to the terminal and the combined log
#   steps_finish
#
# Results: PASS, FAIL, TIMEOUT, SKIP (not selected), NOT STARTED; DETAIL is
# the result line's wording ("FAIL (exit 2)", "TIMEOUT (300s)"), the result
# itself by default. After each record, the function named by
# steps_record_hook (when set) is called with NAME RESULT DETAIL SECONDS.
# The outcomes so far are in steps_names, steps_results, steps_details and
# steps_seconds.

steps_prefix=steps
steps_log_dir=.
steps_combined_log=/dev/null
steps_summary_file=/dev/null
steps_selected=()
steps_names=()
steps_results=()
steps_details=()
steps_seconds=()
steps_record_hook=

steps_init() {
  local prefix=$1 log_dir=$2 report_dir=$3 known=() named=() wanted
  shift 3
  while [[ $# -gt 0 && $1 != -- ]]; do
    known+=("$1")
    shift
  done
  [[ $# -gt 0 ]] && shift
  named=("$@")
  for wanted in "${named[@]}"; do
    case " ${known[*]} " in
      *" $wanted "*) ;;
      *) echo "$prefix: unknown step '$wanted' (steps: ${known[*]})" >&2; exit 2 ;;
    esac
  done
  if [[ ${#named[@]} -gt 0 ]]; then
    steps_selected=("${named[@]}")
  else
    steps_selected=("${known[@]}")
  fi
  steps_prefix=$prefix
  steps_log_dir=$log_dir
  steps_combined_log="$report_dir/$prefix.log"
  steps_summary_file="$report_dir/$prefix-summary.txt"
  mkdir -p "$log_dir" "$report_dir"
  : >"$steps_combined_log"
}

steps_is_selected() {
  local wanted
  for wanted in "${steps_selected[@]}"; do
    [[ $wanted == "$1" ]] && return 0
  done
  return 1
}

steps_now_ns() { date +%s%N; }

# Seconds with one decimal from two nanosecond stamps (integer arithmetic).
steps_elapsed() {
  local ms=$(( ($2 - $1) / 1000000 ))
  printf '%d.%d' $(( ms / 1000 )) $(( (ms % 1000) / 100 ))
}

steps_log() {
  echo "$1" | tee -a "$steps_combined_log"
}

steps_record() {
  local name=$1 result=$2 seconds=$3 detail=${4:-$2}
  steps_names+=("$name")
  steps_results+=("$result")
  steps_details+=("$detail")
  steps_seconds+=("$seconds")
  if [[ -n $steps_record_hook ]]; then
    "$steps_record_hook" "$name" "$result" "$detail" "$seconds"
  fi
}

steps_call() {
  local fn rc=0 fn_rc errexit=0
  [[ $- == *e* ]] && errexit=1
  set +e
  for fn in "$@"; do
    # A plain statement, not `( ... ) || ...`: -e is ignored in a subshell
    # on the left of || or &&.
    ( set -ex; "$fn" )
    fn_rc=$?
    [[ $rc -eq 0 ]] && rc=$fn_rc
  done
  [[ $errexit -eq 1 ]] && set -e
  return $rc
}

steps_run() {
  if steps_is_selected "$1"; then
    steps_step "$@"
  else
    steps_record "$1" SKIP 0.0
  fi
}

steps_step() {
  local limit=
  if [[ $1 == --limit ]]; then
    limit=$2
    shift 2
  fi
  local name=$1
  shift
  local is_function=0 line
  declare -F "$1" >/dev/null && is_function=1
  if [[ -n $limit && $is_function -eq 1 ]]; then
    echo "$steps_prefix: step '$name': a time limit needs a command, not the function $1" >&2
    steps_record "$name" FAIL 0.0 "FAIL (no command)"
    return 0
  fi
  line="=== $steps_prefix step '$name' ($(date -u +%H:%M:%S) UTC${limit:+, limit ${limit}s})"
  [[ $is_function -eq 0 ]] && line+=": $*"
  steps_log "$line"
  local start rc errexit=0
  [[ $- == *e* ]] && errexit=1
  start=$(steps_now_ns)
  set +e
  if [[ $is_function -eq 1 ]]; then
    steps_call "$1" 2>&1 | tee "$steps_log_dir/$name.log" | tee -a "$steps_combined_log"
  elif [[ -n $limit ]]; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$steps_log_dir/$name.log" | tee -a "$steps_combined_log"
  else
    "$@" 2>&1 | tee "$steps_log_dir/$name.log" | tee -a "$steps_combined_log"
  fi
  rc=${PIPESTATUS[0]}
  [[ $errexit -eq 1 ]] && set -e
  local seconds result detail
  seconds=$(steps_elapsed "$start" "$(steps_now_ns)")
  if [[ $rc -eq 0 ]]; then
    result=PASS detail=PASS
  elif [[ -n $limit && ( $rc -eq 124 || $rc -eq 137 ) ]]; then
    result=TIMEOUT detail="TIMEOUT (${limit}s)"
  else
    result=FAIL detail="FAIL (exit $rc)"
  fi
  steps_log "=== $steps_prefix step '$name': $detail in ${seconds}s"
  steps_record "$name" "$result" "$seconds" "$detail"
}

steps_finish() {
  local passed=0 failed=0 result i
  for result in "${steps_results[@]}"; do
    case $result in
      PASS) passed=$((passed + 1)) ;;
      SKIP) ;;
      *) failed=$((failed + 1)) ;;
    esac
  done
  {
    printf '%-8s %-6s %8s\n' STEP RESULT SECONDS
    for i in "${!steps_names[@]}"; do
      printf '%-8s %-6s %8s\n' "${steps_names[$i]}" "${steps_results[$i]}" "${steps_seconds[$i]}"
    done
    echo "$steps_prefix: $passed passed, $failed failed"
  } | tee "$steps_summary_file" | tee -a "$steps_combined_log"
  [[ $failed -eq 0 ]]
}
