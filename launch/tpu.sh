#!/usr/bin/env bash
# Cloud TPU VM launcher: create a slice, install t5x_like on every worker, run
# `t5x-like train` on all of them, follow the logs, delete the slice.
#
#   CONFIG=configs/bert_pretrain.py:base ACCELERATOR=v3-32 \
#     WORKDIR=gs://my-bucket/bert-base launch/tpu.sh all
#
# Configured by environment variables (launch/README.md lists them all).
# DRY_RUN=1 prints every command instead of running it.
set -euo pipefail

PROG=tpu.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LIBTPU_FIND_LINKS=https://storage.googleapis.com/jax-releases/libtpu_releases.html
# shellcheck disable=SC2088  # (the tilde is for the remote shell)
REMOTE_LOG='~/t5x_like_train.log'
# shellcheck disable=SC2088
REMOTE_PIDFILE='~/t5x_like_train.pid'
# shellcheck disable=SC2088
REMOTE_SUPERVISED_PIDFILE='~/t5x_like_train.supervised.pid'

usage() {
  cat <<'EOF'
usage: [VAR=value ...] launch/tpu.sh SUBCOMMAND [ARGS]

subcommands:
  create   create the TPU VM (single host) or a queued resource (pod) and wait for it
  setup    copy this repository to every worker, make a venv, pip install jax[tpu] + t5x_like
  run      start `t5x-like train` on every worker in the background (ARGS: extra
           --config.key=value flags, appended to EXTRA_ARGS)
  supervise  run `t5x-like train` on every worker in the foreground, one ssh per worker,
           from a supervisor on this machine that restarts all of them when one is lost
           (preempted, killed, host gone) and stops on a user error or a failure
           (ARGS as for run; Ctrl-C stops every worker, which saves)
  logs     follow the training log of worker $WORKER (default 0)
  stop     stop the training run on every worker
  status   show the state of the TPU / queued resource
  ssh      ssh into worker $WORKER (default 0); ARGS, if any, are run as a command
  delete   delete the TPU (or the queued resource, with --force)
  all      create, setup, run, then logs (SUPERVISE=1: create, setup, supervise)

variables (defaults in brackets):
  ACCELERATOR      accelerator type, e.g. v3-8, v3-32, v4-64, v5p-128, v5litepod-16, v6e-8 (required)
  TPU_NAME         [t5x-like-$ACCELERATOR]       QR_NAME  [$TPU_NAME-qr]
  ZONE             [per generation, e.g. europe-west4-a for v3]
  RUNTIME_VERSION  [tpu-ubuntu2204-base for v2-v4, v2-alpha-tpuv5 for v5p, ...]
  PROJECT          gcloud project [the gcloud default]
  QUEUED           auto|1|0 [auto: queued resources for multi-host slices]
  SPOT, PREEMPTIBLE, RESERVED   1 to request that capacity type
  CONFIG           FILE[:ARG] relative to the repository root (run, all)
  WORKDIR          gs://bucket/path (a local path only on a single host) (run, all)
  EXTRA_ARGS       extra `t5x-like train` flags, e.g. '--config.train.steps=1000'
  JAX_SPEC         [jax[tpu]]   PYTHON [python3.11]   VENV [~/t5x_like_venv]
  WORKER           worker index for logs and ssh [0]
  POLL_SECONDS     queued-resource poll interval [60]
  SUPERVISE        1: `all` ends with supervise instead of run and logs
  MAX_RESTARTS     supervise: restarts before giving up [3]
  STOP_GRACE_SECONDS, RESTART_DELAY_SECONDS   supervise: SIGTERM-to-SIGKILL wait [60],
                   pause before a restart [30]
  LOCAL_PYTHON     supervise: the python3 that runs the supervisor here [python3]
  SIMULATE         supervise with DRY_RUN=1: PROCESS:STATUS the dry run ends once [1:137]
  DRY_RUN          1: print the commands, run nothing
EOF
}

# ------------------------------------------------------------ the slice

parse_accelerator() {  # sets GENERATION, CHIPS, HOSTS and the per-generation defaults
  local count default_zone default_runtime
  [[ $ACCELERATOR =~ ^(v[0-9]+[a-z]*)-([0-9]+)$ ]] ||
    die "ACCELERATOR=$ACCELERATOR is not an accelerator type like v3-32 or v5p-128"
  GENERATION=${BASH_REMATCH[1]}
  count=${BASH_REMATCH[2]}
  case $GENERATION in
    v2) default_zone=us-central1-b default_runtime=tpu-ubuntu2204-base ;;
    v3) default_zone=europe-west4-a default_runtime=tpu-ubuntu2204-base ;;
    v4) default_zone=us-central2-b default_runtime=tpu-ubuntu2204-base ;;
    v5p) default_zone=us-east5-a default_runtime=v2-alpha-tpuv5 ;;
    v5litepod) default_zone=us-west4-a default_runtime=v2-alpha-tpuv5-lite ;;
    v6e) default_zone=us-east5-b default_runtime=v2-alpha-tpuv6e ;;
    *) die "ACCELERATOR=$ACCELERATOR: unknown TPU generation $GENERATION (v2, v3, v4, v5p, v5litepod, v6e)" ;;
  esac
  case $GENERATION in
    v2 | v3 | v4 | v5p)  # the number counts TensorCores: 2 per chip, 4 chips per host
      ((count >= 8 && count % 8 == 0)) ||
        die "ACCELERATOR=$ACCELERATOR: $GENERATION slices come in multiples of 8 TensorCores"
      CHIPS=$((count / 2))
      HOSTS=$((count / 8))
      ;;
    *)  # v5e / v6e count chips: up to 8 on one host, 4 per host beyond
      CHIPS=$count
      if ((count <= 8)); then HOSTS=1; else HOSTS=$((count / 4)); fi
      ;;
  esac
  ZONE=${ZONE:-$default_zone}
  RUNTIME_VERSION=${RUNTIME_VERSION:-$default_runtime}
}

load_settings() {
  require ACCELERATOR
  parse_accelerator
  TPU_NAME=${TPU_NAME:-t5x-like-$ACCELERATOR}
  QR_NAME=${QR_NAME:-$TPU_NAME-qr}
  JAX_SPEC=${JAX_SPEC:-jax[tpu]}
  POLL_SECONDS=${POLL_SECONDS:-60}
  MULTI_HOST=0
  if ((HOSTS > 1)); then MULTI_HOST=1; fi
  case ${QUEUED:-auto} in
    auto) USE_QUEUED=$MULTI_HOST ;;
    *) if is_true "$QUEUED"; then USE_QUEUED=1; else USE_QUEUED=0; fi ;;
  esac
  GCLOUD_FLAGS=(--zone "$ZONE")
  if [[ -n ${PROJECT:-} ]]; then GCLOUD_FLAGS+=(--project "$PROJECT"); fi
  TARBALL=${TARBALL:-${TMPDIR:-/tmp}/t5x_like-$TPU_NAME.tar.gz}
  local how=tpu-vm
  if ((USE_QUEUED)); then how="queued resource $QR_NAME"; fi
  note "$ACCELERATOR: $CHIPS chips on $HOSTS host(s); TPU $TPU_NAME ($how) in $ZONE, runtime $RUNTIME_VERSION"
}

check_run_settings() {  # what `run` needs, checked before anything is created
  require CONFIG WORKDIR
  check_config
  if ((MULTI_HOST)) && [[ $WORKDIR != gs://* ]]; then
    die "WORKDIR must be a gs:// path on a multi-host slice ($ACCELERATOR has $HOSTS hosts, each with its own disk; checkpoints need one shared place): got WORKDIR=$WORKDIR"
  fi
}

tpu_vm() { run_or_print gcloud compute tpus tpu-vm "$@" "${GCLOUD_FLAGS[@]}"; }
queued() { run_or_print gcloud compute tpus queued-resources "$@" "${GCLOUD_FLAGS[@]}"; }
on_workers() {  # on_workers WORKERS COMMAND: the command over ssh on those workers
  tpu_vm ssh "$TPU_NAME" --worker="$1" --command "$2"
}

# ---------------------------------------------------------- subcommands

cmd_create() {
  local capacity=()
  if is_true "${SPOT:-0}"; then capacity+=(--spot); fi
  if is_true "${RESERVED:-0}"; then capacity+=(--reserved); fi
  if is_true "${PREEMPTIBLE:-0}"; then
    ((USE_QUEUED)) && die "PREEMPTIBLE is not offered by queued resources; use SPOT=1"
    capacity+=(--preemptible)
  fi
  if ((USE_QUEUED)); then
    queued create "$QR_NAME" --node-id "$TPU_NAME" --accelerator-type "$ACCELERATOR" \
      --runtime-version "$RUNTIME_VERSION" ${capacity[@]+"${capacity[@]}"}
    wait_until_active
  else
    tpu_vm create "$TPU_NAME" --accelerator-type "$ACCELERATOR" \
      --version "$RUNTIME_VERSION" ${capacity[@]+"${capacity[@]}"}
  fi
}

wait_until_active() {
  local describe=(gcloud compute tpus queued-resources describe "$QR_NAME" "${GCLOUD_FLAGS[@]}"
    --format='value(state.state)')
  if is_dry_run; then
    note "wait until the queued resource is ACTIVE, polling every ${POLL_SECONDS}s:"
    run_or_print "${describe[@]}"
    return
  fi
  local state
  while true; do
    state=$(run_or_print "${describe[@]}")
    case $state in
      ACTIVE) note "queued resource $QR_NAME is ACTIVE"; return ;;
      FAILED | SUSPENDED) die "queued resource $QR_NAME is $state (see: gcloud compute tpus queued-resources describe $QR_NAME --zone $ZONE)" ;;
    esac
    note "queued resource $QR_NAME is ${state:-unknown}; polling again in ${POLL_SECONDS}s"
    sleep "$POLL_SECONDS"
  done
}

cmd_setup() {
  make_tarball "$TARBALL"
  tpu_vm scp "$TARBALL" "$TPU_NAME:$REMOTE_TARBALL_NAME" --worker=all
  run_or_print rm -f "$TARBALL"
  on_workers all "$(remote_setup_command "$JAX_SPEC" -f "$LIBTPU_FIND_LINKS")"
}

cmd_run() {
  check_run_settings
  collect_extra_args "$@"
  local flags=(--config "$CONFIG" --workdir "$WORKDIR")
  # One process per host; on a pod jax.distributed finds its peers from the TPU metadata.
  if ((MULTI_HOST)); then flags+=(--distributed=auto); fi
  on_workers all "$(remote_train_command "$REMOTE_LOG" "$REMOTE_PIDFILE" '' \
    "${flags[@]}" ${EXTRA[@]+"${EXTRA[@]}"})"
}

cmd_supervise() {
  check_run_settings
  collect_extra_args "$@"
  local flags=(--config "$CONFIG" --workdir "$WORKDIR") args=() i train term kill
  if ((MULTI_HOST)); then flags+=(--distributed=auto); fi
  train=$(remote_supervised_command "$REMOTE_LOG" "$REMOTE_SUPERVISED_PIDFILE" '' \
    "${flags[@]}" ${EXTRA[@]+"${EXTRA[@]}"})
  term=$(remote_signal_command "$REMOTE_SUPERVISED_PIDFILE" TERM)
  kill=$(remote_signal_command "$REMOTE_SUPERVISED_PIDFILE" KILL)
  for ((i = 0; i < HOSTS; i++)); do  # one ssh per worker: the supervisor sees each status
    args+=(--worker "$(worker_ssh "$i" "$train")" --stop "$(worker_ssh "$i" "$term")"
      --kill "$(worker_ssh "$i" "$kill")")
  done
  run_supervisor --workdir "$WORKDIR" "${args[@]}"
}

worker_ssh() {  # worker_ssh WORKER COMMAND: the gcloud ssh line, as one shell string
  quote_words gcloud compute tpus tpu-vm ssh "$TPU_NAME" --worker="$1" --command "$2" \
    "${GCLOUD_FLAGS[@]}" --ssh-flag=-oServerAliveInterval=15 --ssh-flag=-oServerAliveCountMax=4
}

cmd_logs() { on_workers "${WORKER:-0}" "tail -n +1 -F $REMOTE_LOG"; }
cmd_stop() { on_workers all "$(remote_stop_command "$REMOTE_PIDFILE")"; }

cmd_status() {
  if ((USE_QUEUED)); then queued describe "$QR_NAME"; else tpu_vm describe "$TPU_NAME"; fi
}

cmd_ssh() {
  if (($#)); then
    on_workers "${WORKER:-0}" "$*"
  else
    tpu_vm ssh "$TPU_NAME" --worker="${WORKER:-0}"
  fi
}

cmd_delete() {
  if ((USE_QUEUED)); then
    queued delete "$QR_NAME" --force --quiet
  else
    tpu_vm delete "$TPU_NAME" --quiet
  fi
}

cmd_all() {
  check_run_settings  # fail before paying for a slice
  cmd_create
  cmd_setup
  if is_true "${SUPERVISE:-0}"; then
    cmd_supervise "$@"
    return
  fi
  cmd_run "$@"
  cmd_logs
}

main() {
  (($#)) || usage_error "missing SUBCOMMAND"
  local sub=$1
  shift
  case $sub in
    -h | --help | help) usage; return 0 ;;
    create | setup | run | supervise | logs | stop | status | ssh | delete | all) ;;
    *) usage_error "unknown subcommand: $sub" ;;
  esac
  case $sub in
    run | supervise | all | ssh) ;;
    *) (($# == 0)) || usage_error "$sub takes no arguments (got: $*)" ;;
  esac
  load_settings
  "cmd_$sub" "$@"
}

main "$@"
