#!/usr/bin/env bash
# The GPU benchmark table of docs/benchmarks.md on one GPU host, each variant with
# its profile table (`bench model --profile`): kernels, loss, remat, scan, XLA flags,
# and the PyTorch peers. Run from anywhere; results go to OUT.
#
#   OUT=/tmp/gpu STEPS="bert_auto bert_explicit gpt2 peer_gpt2" launch/gpu_bench.sh
#   launch/gpu_bench.sh list        # the steps and what each runs
#
# Every step writes OUT/STEP.json (stdout of the bench), OUT/STEP.log (stderr: the
# profile table, kernels, errors) and, with a profile, OUT/STEP.prof/. A step that fails
# is recorded in OUT/summary.txt and the next one runs. DRY_RUN=1 prints the commands.
set -euo pipefail

PROG=gpu_bench.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: [OUT=DIR] [STEPS="a b ..."] launch/gpu_bench.sh [run|list]

variables (defaults in brackets):
  OUT        [gpu_bench_out] folder for the JSON, logs and profiles
  STEPS      [all of `list`, in order] the steps to run
  T5X        [t5x-like if on PATH, else python3 with a runner of t5x_like.cli]
  TIMEOUT    [540] seconds one step may take before it is stopped
  DRY_RUN    1: print the commands, run nothing
EOF
}

BERT_LARGE="--config configs/bert_pretrain.py:large --config.data.length=512 --config.data.options.max_predictions_per_seq=80 --config.train.batch_size=32"
GPT2="--config configs/gpt2_pretrain.py:124m --config.train.batch_size=32"
T5="--config configs/t5_pretrain.py:base --config.train.batch_size=128"
BENCH="bench model --steps 20 --warmup 3 --nodecode"

# name|environment|arguments (after `t5x-like`); PROFILE in the arguments becomes
# `--profile OUT/name.prof`.
STEP_TABLE="
attention||bench attention --length 512 --heads 16 --head_dim 64 --dtype bfloat16 --steps 20
bert_auto||$BENCH $BERT_LARGE PROFILE
bert_explicit||$BENCH $BERT_LARGE --config.model.attention_impl=explicit PROFILE
bert_remat_auto||$BENCH $BERT_LARGE --config.model.remat_policy=auto PROFILE
bert_unrolled||$BENCH $BERT_LARGE --config.model.remat_policy=auto --config.model.scan_layers=false PROFILE
bert_nodrop_cudnn||$BENCH $BERT_LARGE --config.model.attention_impl=cudnn --config.model.overrides.attention_dropout_rate=0.0 PROFILE
gpt2||$BENCH $GPT2 PROFILE
gpt2_full_logits||$BENCH $GPT2 --config.model.overrides.loss_chunk_rows=0 PROFILE
gpt2_remat_auto||$BENCH $GPT2 --config.model.remat_policy=auto PROFILE
gpt2_flags_candidates|T5X_LIKE_GPU_XLA_FLAGS=candidates|$BENCH $GPT2 PROFILE
gpt2_flags_none|T5X_LIKE_GPU_XLA_FLAGS=none|$BENCH $GPT2 PROFILE
t5||$BENCH $T5 PROFILE
t5_remat_auto||$BENCH $T5 --config.model.remat_policy=auto PROFILE
t5_full_logits||$BENCH $T5 --config.model.overrides.loss_chunk_rows=0 PROFILE
peer_gpt2||bench peer $GPT2 --steps 20 --rounds 1
peer_bert||bench peer $BERT_LARGE --steps 20 --rounds 1
resume_pallas_gpu||(a SIGKILL after the save at step 8 and a rerun, against an uninterrupted run)
compare||(the losses of bert_auto against bert_explicit, of resume_pallas_gpu against its whole run)
"

# resume_pallas_gpu: BERT-tiny (bf16, attention dropout 0.1) through the Pallas GPU kernel.
RESUME="train --config configs/bert_cpu.py --config.model.attention_impl=pallas_gpu --config.train.num_steps=24 --config.train.log_every=1 --config.train.checkpoint_every=8 --config.train.eval_every=16 --config.train.async_checkpoints=False --config.optimizer.warmup_steps=4"

step_names() { printf '%s\n' "$STEP_TABLE" | sed -n 's/^\([a-z0-9_]*\)|.*/\1/p'; }

step_line() {  # step_line NAME: its table line, or nothing
  printf '%s\n' "$STEP_TABLE" | grep "^$1|" || true
}

runner() {  # the command that runs t5x-like here
  if [[ -n ${T5X:-} ]]; then
    printf '%s' "$T5X"
  elif command -v t5x-like >/dev/null 2>&1; then
    printf 't5x-like'
  else
    # cli.py re-executes sys.executable with sys.argv: it must start from a file.
    local dir
    dir=$(mktemp -d)
    printf 'import sys\nfrom t5x_like.cli import main\nsys.exit(main())\n' >"$dir/t5x_like_cli.py"
    printf 'env PYTHONPATH=%s python3 %s' "$(printf '%q' "${PYTHONPATH:+$PYTHONPATH:}$REPO_ROOT")" "$dir/t5x_like_cli.py"
  fi
}

run_step() {  # run_step NAME RUNNER
  local name=$1 t5x=$2 line env_part args_part start rc
  line=$(step_line "$name")
  [[ -n $line ]] || usage_error "unknown step '$name' (launch/gpu_bench.sh list)"
  case $name in
    resume_pallas_gpu) run_logged "$name" resume_check "$t5x"; return 0 ;;
    compare) run_logged "$name" compare_losses; return 0 ;;
  esac
  env_part=$(printf '%s' "$line" | cut -d'|' -f2)
  args_part=$(printf '%s' "$line" | cut -d'|' -f3)
  args_part=${args_part/PROFILE/--profile $OUT/$name.prof}
  local cmd="${env_part:+env $env_part }timeout ${TIMEOUT:-540} $t5x $args_part"
  if is_dry_run; then
    printf '+ %s > %s 2> %s\n' "$cmd" "$OUT/$name.json" "$OUT/$name.log"
    return 0
  fi
  start=$SECONDS
  rc=0
  # shellcheck disable=SC2086  # word splitting of the table's arguments is wanted
  (cd "$REPO_ROOT" && eval "$cmd") >"$OUT/$name.json" 2>"$OUT/$name.log" || rc=$?
  printf '%-24s exit %3d  %4d s\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/summary.txt" >&2
}

run_logged() {  # run_logged NAME FUNCTION ARGS...: OUT/NAME.log and a summary line
  local name=$1 start rc=0
  shift
  if is_dry_run; then
    printf '+ %s\n' "$*"
    return 0
  fi
  start=$SECONDS
  (cd "$REPO_ROOT" && "$@") >"$OUT/$name.log" 2>&1 || rc=$?
  printf '%-24s exit %3d  %4d s\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/summary.txt" >&2
}

resume_check() {  # resume_check RUNNER: whole run, killed run + rerun; equal losses
  local t5x=$1 rc=0
  rm -rf "$OUT/resume_whole" "$OUT/resume_killed"
  eval "$t5x $RESUME --workdir $OUT/resume_whole"
  eval "T5X_LIKE_FAILPOINT=after_save@8 $t5x $RESUME --workdir $OUT/resume_killed" || rc=$?
  echo "killed run: exit $rc (137 expected: SIGKILL)"
  [[ $rc -eq 137 ]] || return 1
  eval "$t5x $RESUME --workdir $OUT/resume_killed"
  python3 - "$OUT/resume_whole/metrics.jsonl" "$OUT/resume_killed/metrics.jsonl" <<'PY'
import json, sys
def losses(path):
  rows = [json.loads(l) for l in open(path) if l.strip()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}
whole, killed = (losses(p) for p in sys.argv[1:])
same = whole == killed and len(whole) == 24
print(f"{len(whole)} steps; resumed losses equal the uninterrupted run's bit for bit: {same}")
sys.exit(0 if same else 1)
PY
}

compare_losses() {  # the fused kernel's 20+3 losses against the explicit kernel's
  python3 - "$OUT/bert_auto.json" "$OUT/bert_explicit.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
la, lb = a["train"]["losses"], b["train"]["losses"]
worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
print(f"kernels {a['attention_kernels']} vs {b['attention_kernels']}")
print(f"{len(la)} steps, largest relative loss difference {worst:.4f} (bf16: < 0.02)")
sys.exit(0 if worst < 0.02 else 1)
PY
}

main() {
  local sub=${1:-run}
  case $sub in
    -h | --help) usage; return 0 ;;
    list) printf '%s\n' "$STEP_TABLE" | sed '/^$/d'; return 0 ;;
    run) ;;
    *) usage_error "unknown subcommand '$sub'" ;;
  esac
  OUT=${OUT:-gpu_bench_out}
  local steps name t5x
  steps=${STEPS:-$(step_names | tr '\n' ' ')}
  for name in $steps; do
    [[ -n $(step_line "$name") ]] || usage_error "unknown step '$name' (launch/gpu_bench.sh list)"
  done
  is_dry_run || mkdir -p "$OUT"
  t5x=$(runner)
  note "steps: $steps"
  for name in $steps; do
    run_step "$name" "$t5x"
  done
}

main "$@"
