#!/usr/bin/env bash
# Captures the allocation-trace corpus (tests/data/traces/README.md): runs
# every workload of bench/workloads under scripts/capture_trace.py on the
# GPU and writes OUTDIR/NAME.trace.csv.gz, with each capture's output in
# OUTDIR/logs/NAME.log. A failing or timed-out capture is reported and the
# next one runs; the summary at the end lists every capture with its status,
# time and size, and the exit status is 1 when any failed.
#
#   scripts/capture_corpus.sh OUTDIR [all | new | NAME...]
#
#   all   (default) every trace of the corpus
#   new   the traces added with issue 16 (not the three captured before)
#   NAME  the named traces only (see `scripts/capture_corpus.sh --list`)
#
# Environment: PYTHON (default python3; needs torch with CUDA, torchvision,
# transformers, and peft for lora_finetune), CAPTURE_TIMEOUT_S (one
# capture's limit, default 300), CORPUS_TIME_LIMIT_S (no capture starts once
# this many seconds have passed; default 0, no limit), REPLAY_BIN (a built
# streamalloc-replay: replays the captured folder with --all at the end).
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# NAME|SCRIPT|ARGS: the corpus. The first three are the traces captured
# before the corpus grew; their arguments are the workloads' defaults.
corpus=(
  "gpt2_train_varlen|gpt2_train_varlen.py|"
  "gpt2_generate|gpt2_generate.py|"
  "resnet50_fixed_batch|resnet50_train_fixed.py|"
  "hf_llama_train_varlen|hf_llama_train.py|"
  "hf_llama_train_varlen_ckpt|hf_llama_train.py|--checkpointing"
  "hf_generate_dynamic|hf_generate.py|--cache dynamic"
  "hf_generate_static|hf_generate.py|--cache static"
  "bert_serve|bert_serve.py|"
  "resnet50_train_varsize|vision_train.py|--model resnet50"
  "vit_b16_train_varbatch|vision_train.py|--model vit_b_16"
  "moe_train|moe_train.py|"
  "unet_diffusion|unet_diffusion.py|"
  "pipeline_1f1b|pipeline_1f1b.py|"
  "offload_activations|offload_activations.py|"
  "fsdp2_streams2|fsdp2_streams.py|--streams 2"
  "fsdp2_streams4|fsdp2_streams.py|--streams 4"
  "inference_server|inference_server.py|--streams 2"
  "bert_serve_inflight8|bert_serve.py|--seed 1 --max-batch 32 --in-flight 8"
  "fsdp2_streams2_deep|fsdp2_streams.py|--streams 2 --seed 1 --layers 24 --world 4"
  "fsdp2_streams4_long|fsdp2_streams.py|--streams 4 --seed 2 --batch 4 --max-len 2048"
  "hf_generate_dynamic_long|hf_generate.py|--cache dynamic --seed 2 --min-batch 4 --max-batch 24 --max-new 96"
  "hf_generate_static_wide|hf_generate.py|--cache static --seed 1 --max-batch 32 --max-prompt 768"
  "hf_llama_train_longctx|hf_llama_train.py|--seed 1 --batch 4 --min-len 128 --max-len 2048 --steps 16"
  "moe_train_top1|moe_train.py|--seed 1 --experts 16 --top-k 1"
  "offload_activations_4mb|offload_activations.py|--seed 1 --threshold-mb 4 --batch 8"
  "t5_beam_generate|t5_generate.py|"
  "detection_train|detection_train.py|"
  "lstm_train_varlen|lstm_varlen.py|"
  "recsys_sparse_train|recsys_train.py|"
  "continuous_batching|continuous_batching.py|"
  "compile_train|compile_train.py|"
  "amp_accumulate|amp_accumulate.py|"
  "rl_rollout_train|rl_rollout_train.py|"
  "inference_server_streams8|inference_server.py|--streams 8 --seed 1"
  "speculative_decode|speculative_decode.py|"
  "train_eval_loop|train_eval_loop.py|"
  "gnn_train|gnn_train.py|"
  "segmentation_train_varsize|segmentation_train.py|"
  "stream_pipeline_infer|stream_pipeline_infer.py|"
  "sampled_generate|sampled_generate.py|"
  "bert_serve_inflight6|bert_serve.py|--seed 9 --in-flight 6"
  "fsdp2_streams4_world4|fsdp2_streams.py|--streams 4 --seed 6 --world 4"
  "hf_generate_static_seed7|hf_generate.py|--cache static --seed 7"
  "sampled_generate_seed5|sampled_generate.py|--seed 5"
  "seq2seq_train|seq2seq_train.py|"
  "clip_train|clip_train.py|"
  "gan_train|gan_train.py|"
  "lora_finetune|lora_finetune.py|"
  "optimizer_offload_train|optimizer_offload_train.py|"
  "chunked_prefill_serve|chunked_prefill_serve.py|"
  "dpo_train|dpo_train.py|"
  "convnext_train_varsize|vision_train.py|--model convnext_tiny"
  "mamba_train_varlen|mamba_train.py|"
)
existing=(gpt2_train_varlen gpt2_generate resnet50_fixed_batch)

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

if [[ ${1:-} == --list ]]; then
  for entry in "${corpus[@]}"; do
    IFS='|' read -r name script args <<<"$entry"
    printf '%-28s bench/workloads/%s %s\n' "$name" "$script" "$args"
  done
  exit 0
fi
[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
[[ $# -ge 1 ]] || usage 2
out_dir=$1
shift

selected=()
if [[ $# -eq 0 || $1 == all ]]; then
  for entry in "${corpus[@]}"; do selected+=("${entry%%|*}"); done
elif [[ $1 == new ]]; then
  for entry in "${corpus[@]}"; do
    name=${entry%%|*}
    [[ " ${existing[*]} " == *" $name "* ]] || selected+=("$name")
  done
else
  for name in "$@"; do
    found=0
    for entry in "${corpus[@]}"; do [[ ${entry%%|*} == "$name" ]] && found=1; done
    if [[ $found -eq 0 ]]; then
      echo "capture_corpus: unknown trace '$name' (see --list)" >&2
      exit 2
    fi
    selected+=("$name")
  done
fi

python_bin="${PYTHON:-python3}"
timeout_s="${CAPTURE_TIMEOUT_S:-300}"
time_limit="${CORPUS_TIME_LIMIT_S:-0}"
mkdir -p "$out_dir/logs" || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

names=()
results=()
seconds=()
sizes=()
failed=0
for name in "${selected[@]}"; do
  for entry in "${corpus[@]}"; do [[ ${entry%%|*} == "$name" ]] && break; done
  IFS='|' read -r _ script args <<<"$entry"
  trace="$out_dir/$name.trace.csv.gz"
  log="$out_dir/logs/$name.log"
  names+=("$name")
  if [[ $time_limit -gt 0 && $SECONDS -ge $time_limit ]]; then
    results+=("NOT STARTED (CORPUS_TIME_LIMIT_S=$time_limit)")
    seconds+=("-")
    sizes+=("-")
    failed=1
    continue
  fi
  rm -f "$trace"
  echo "=== capture_corpus: $name: bench/workloads/$script $args"
  start=$SECONDS
  # shellcheck disable=SC2086  # ARGS is a word list by design
  (cd "$repo_root" && timeout --kill-after=10 "$timeout_s" "$python_bin" scripts/capture_trace.py -o "$trace" \
    -- "bench/workloads/$script" $args) >"$log" 2>&1
  rc=$?
  tail -n 3 "$log"
  elapsed=$((SECONDS - start))
  if [[ $rc -eq 0 && -s $trace ]]; then
    results+=("ok")
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    results+=("TIMEOUT (${timeout_s}s)")
    failed=1
  else
    results+=("FAILED (exit $rc, see logs/$name.log)")
    failed=1
  fi
  seconds+=("$elapsed")
  if [[ -s $trace ]]; then sizes+=("$(du -k "$trace" | cut -f1) KiB"); else sizes+=("-"); fi
done

echo
echo "capture_corpus: ${#names[@]} traces into $out_dir in ${SECONDS}s"
printf '%-28s %-8s %-10s %s\n' trace seconds size result
for i in "${!names[@]}"; do
  printf '%-28s %-8s %-10s %s\n' "${names[$i]}" "${seconds[$i]}" "${sizes[$i]}" "${results[$i]}"
done

if [[ -n ${REPLAY_BIN:-} ]]; then
  echo
  echo "=== capture_corpus: $REPLAY_BIN --all $out_dir"
  "$REPLAY_BIN" --all "$out_dir" || failed=1
fi
exit $failed
