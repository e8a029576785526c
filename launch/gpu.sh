#!/usr/bin/env bash
# Multi-node GPU launcher over plain ssh: copy t5x_like to every host, install
# it with jax[cuda12], start one `t5x-like train` process per host (process i on
# host i, all meeting at the first host's coordinator), follow logs, stop.
#
#   HOSTS=gpu-node-0,gpu-node-1 CONFIG=configs/bert_pretrain.py:base \
#     WORKDIR=gs://my-bucket/bert-base launch/gpu.sh setup
#   HOSTS=... CONFIG=... WORKDIR=... launch/gpu.sh run
#
# Configured by environment variables (launch/README.md lists them all).
# DRY_RUN=1 prints every command instead of running it.
set -euo pipefail

PROG=gpu.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: [VAR=value ...] launch/gpu.sh SUBCOMMAND [ARGS]

subcommands:
  setup    copy this repository to every host, make a venv, pip install jax[cuda12] + t5x_like
  run      start `t5x-like train` on every host in the background, process i on host i
           (ARGS: extra --config.key=value flags, appended to EXTRA_ARGS)
  supervise  run `t5x-like train` on every host in the foreground, one ssh per host, from
           a supervisor on this machine that restarts all of them when one is lost and
           stops on a user error or a failure (ARGS as for run; Ctrl-C stops them all)
  logs     follow the training log of process $WORKER (default 0)
  stop     stop the training process on every host

variables (defaults in brackets):
  HOSTS             comma-separated ssh targets ([user@]host); the first is the coordinator (required)
  COORDINATOR_HOST  [the first host, without user@]: address the others reach it at
  COORDINATOR_PORT  [1234]
  GPUS_PER_NODE     use GPUs 0..N-1 of every host [all visible GPUs]
  CONFIG            FILE[:ARG] relative to the repository root (run)
  WORKDIR           shared by all hosts: gs://bucket/path or a shared filesystem (run)
  EXTRA_ARGS        extra `t5x-like train` flags, e.g. '--config.train.steps=1000'
  JAX_SPEC          [jax[cuda12]]   PYTHON [python3.11]   VENV [~/t5x_like_venv]
  SSH_FLAGS         extra ssh/scp options, e.g. '-o StrictHostKeyChecking=accept-new'
  WORKER            process index for logs [0]
  MAX_RESTARTS      supervise: restarts before giving up [3]
  STOP_GRACE_SECONDS, RESTART_DELAY_SECONDS   supervise: SIGTERM-to-SIGKILL wait [60],
                    pause before a restart [30]
  LOCAL_PYTHON      supervise: the python3 that runs the supervisor here [python3]
  SIMULATE          supervise with DRY_RUN=1: PROCESS:STATUS the dry run ends once [1:137]
  DRY_RUN           1: print the commands, run nothing
EOF
}

load_settings() {
  require HOSTS
  local host_csv=${HOSTS// /}
  HOST_LIST=()
  IFS=, read -r -a HOST_LIST <<<"$host_csv" || true
  local host
  for host in ${HOST_LIST[@]+"${HOST_LIST[@]}"}; do
    [[ -n $host ]] || die "HOSTS=$HOSTS has an empty entry"
  done
  NUM_PROCESSES=${#HOST_LIST[@]}
  ((NUM_PROCESSES > 0)) || die "HOSTS=$HOSTS names no host"
  local first=${HOST_LIST[0]}
  COORDINATOR_HOST=${COORDINATOR_HOST:-${first#*@}}
  COORDINATOR_PORT=${COORDINATOR_PORT:-1234}
  [[ $COORDINATOR_PORT =~ ^[0-9]+$ ]] || die "COORDINATOR_PORT=$COORDINATOR_PORT is not a port number"
  JAX_SPEC=${JAX_SPEC:-jax[cuda12]}
  SSH_OPTS=()
  read -r -a SSH_OPTS <<<"${SSH_FLAGS:-}" || true
  TARBALL=${TARBALL:-${TMPDIR:-/tmp}/t5x_like-gpu.tar.gz}
  note "$NUM_PROCESSES host(s): ${HOST_LIST[*]}; coordinator $COORDINATOR_HOST:$COORDINATOR_PORT"
}

on_host() {  # on_host HOST COMMAND
  run_or_print ssh ${SSH_OPTS[@]+"${SSH_OPTS[@]}"} "$1" "$2"
}

# Per-process names: hosts may share a home directory over NFS.
# shellcheck disable=SC2088  # (the tilde is for the remote shell)
log_file() { printf '~/t5x_like_train.process_%s.log' "$1"; }
# shellcheck disable=SC2088
pid_file() { printf '~/t5x_like_train.process_%s.pid' "$1"; }
# shellcheck disable=SC2088
supervised_pid_file() { printf '~/t5x_like_train.process_%s.supervised.pid' "$1"; }

cmd_setup() {
  make_tarball "$TARBALL"
  local host setup
  setup=$(remote_setup_command "$JAX_SPEC")
  for host in "${HOST_LIST[@]}"; do
    run_or_print scp ${SSH_OPTS[@]+"${SSH_OPTS[@]}"} "$TARBALL" "$host:$REMOTE_TARBALL_NAME"
    on_host "$host" "$setup"
  done
  run_or_print rm -f "$TARBALL"
}

cmd_run() {
  check_gpu_run_settings
  collect_extra_args "$@"
  local i
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    set_train_flags "$i"
    on_host "${HOST_LIST[i]}" "$(remote_train_command "$(log_file "$i")" "$(pid_file "$i")" \
      "$ENV_PREFIX" "${TRAIN_FLAGS[@]}")"
  done
}

cmd_supervise() {
  check_gpu_run_settings
  collect_extra_args "$@"
  local i train pidfile args=()
  for ((i = 0; i < NUM_PROCESSES; i++)); do  # one ssh per host: the supervisor sees each status
    pidfile=$(supervised_pid_file "$i")
    set_train_flags "$i"
    train=$(remote_supervised_command "$(log_file "$i")" "$pidfile" "$ENV_PREFIX" \
      "${TRAIN_FLAGS[@]}")
    args+=(--worker "$(host_ssh "$i" "$train")"
      --stop "$(host_ssh "$i" "$(remote_signal_command "$pidfile" TERM)")"
      --kill "$(host_ssh "$i" "$(remote_signal_command "$pidfile" KILL)")")
  done
  run_supervisor --workdir "$WORKDIR" "${args[@]}"
}

host_ssh() {  # host_ssh I COMMAND: the ssh line to host I, as one shell string
  quote_words ssh "${SSH_KEEPALIVE[@]}" ${SSH_OPTS[@]+"${SSH_OPTS[@]}"} "${HOST_LIST[$1]}" "$2"
}

check_gpu_run_settings() {  # checks CONFIG and WORKDIR; sets ENV_PREFIX
  require CONFIG WORKDIR
  check_config
  if ((NUM_PROCESSES > 1)) && [[ $WORKDIR != gs://* ]]; then
    note "WORKDIR=$WORKDIR must be on a filesystem that every host shares (checkpoints are written collectively)"
  fi
  ENV_PREFIX=''
  local i
  if [[ -n ${GPUS_PER_NODE:-} ]]; then
    [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE=$GPUS_PER_NODE is not a positive number"
    local devices=0
    for ((i = 1; i < GPUS_PER_NODE; i++)); do devices+=",$i"; done
    ENV_PREFIX="CUDA_VISIBLE_DEVICES=$devices "
  fi
}

set_train_flags() {  # set_train_flags I: TRAIN_FLAGS=(the flags of process I, EXTRA last)
  TRAIN_FLAGS=(--config "$CONFIG" --workdir "$WORKDIR"
    --coordinator_address="$COORDINATOR_HOST:$COORDINATOR_PORT"
    --num_processes="$NUM_PROCESSES" --process_id="$1" ${EXTRA[@]+"${EXTRA[@]}"})
}

cmd_logs() {
  local i=${WORKER:-0}
  if ! [[ $i =~ ^[0-9]+$ ]] || ((i >= NUM_PROCESSES)); then
    die "WORKER=$i is not a process index (0..$((NUM_PROCESSES - 1)))"
  fi
  on_host "${HOST_LIST[i]}" "tail -n +1 -F $(log_file "$i")"
}

cmd_stop() {
  local i
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    on_host "${HOST_LIST[i]}" "$(remote_stop_command "$(pid_file "$i")")"
  done
}

main() {
  (($#)) || usage_error "missing SUBCOMMAND"
  local sub=$1
  shift
  case $sub in
    -h | --help | help) usage; return 0 ;;
    setup | run | supervise | logs | stop) ;;
    *) usage_error "unknown subcommand: $sub" ;;
  esac
  [[ $sub == run || $sub == supervise ]] || (($# == 0)) || usage_error "$sub takes no arguments (got: $*)"
  load_settings
  "cmd_$sub" "$@"
}

main "$@"
