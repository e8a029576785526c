# shellcheck shell=bash
# Helpers shared by launch/tpu.sh and launch/gpu.sh (sourced, never run).
#
# The sourcing script sets PROG (its name for messages) and defines `usage`.
# Everything here sticks to bash 3.2 (the macOS /bin/bash) so that a laptop can
# drive a pod: no ${x,,}, no associative arrays, no mapfile.

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Where things live on every worker / host (paths relative to the remote home;
# the `~` is expanded by the remote shell).
# shellcheck disable=SC2088  # (the tilde is for the remote shell)
REMOTE_PKG='~/t5x_like'                  # the unpacked repository
REMOTE_TARBALL_NAME='t5x_like.tar.gz'    # scp destination, relative to the remote home
VENV=${VENV:-'~/t5x_like_venv'}          # the virtual environment with jax and t5x_like
PYTHON=${PYTHON:-python3.11}             # pyproject: requires-python >=3.11,<3.12

# ----------------------------------------------------------------- messages

die() {  # error that is the user's to fix: message on stderr, exit 1
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 1
}

usage_error() {  # bad command line: message and usage on stderr, exit 2
  printf '%s: %s\n\n' "$PROG" "$*" >&2
  usage >&2
  exit 2
}

is_true() {
  case ${1:-} in
    1 | true | True | TRUE | yes | Yes | YES | on | On | ON) return 0 ;;
    *) return 1 ;;
  esac
}

is_dry_run() { is_true "${DRY_RUN:-0}"; }

note() {  # a comment line: part of the dry-run transcript, or progress on stderr
  if is_dry_run; then
    printf '# %s\n' "$*"
  else
    printf '%s: %s\n' "$PROG" "$*" >&2
  fi
}

require() {  # require VAR... : each must be set and non-empty
  local name
  for name in "$@"; do
    [[ -n ${!name:-} ]] || die "$name is required (see launch/README.md); e.g. $name=$(example_value "$name")"
  done
}

example_value() {
  case $1 in
    ACCELERATOR) printf 'v3-32' ;;
    CONFIG) printf 'configs/bert_pretrain.py:base' ;;
    WORKDIR) printf 'gs://my-bucket/bert-base' ;;
    HOSTS) printf 'gpu-node-0,gpu-node-1' ;;
    *) printf '...' ;;
  esac
}

# ------------------------------------------------------------------ quoting

shell_quote() {  # one word, quoted (only where needed) so that a shell reads it back
  local word=$1 safe='^[A-Za-z0-9_./:=,@%+-]+$'
  if [[ $word =~ $safe ]]; then
    printf '%s' "$word"
  elif [[ $word =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then  # --flag='value (with spaces)'
    printf '%s' "${BASH_REMATCH[1]}"
    shell_quote "${BASH_REMATCH[2]}"
  elif ((${QUOTE_DOUBLE:-0})) && [[ $word != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$word"  # inside a command that is itself single-quoted
  else
    printf "'%s'" "${word//\'/\'\\\'\'}"
  fi
}

remote_words() {  # quote_words for a command string that travels over ssh
  local QUOTE_DOUBLE=1
  quote_words "$@"
}

quote_words() {  # the words, each quoted, joined by spaces
  local word sep=''
  for word in "$@"; do
    printf '%s' "$sep"
    shell_quote "$word"
    sep=' '
  done
}

# ---------------------------------------------------------- run or print

run_or_print() {  # DRY_RUN=1: print `+ cmd` on stdout; else echo it on stderr and run it
  if is_dry_run; then
    printf '+ %s\n' "$(quote_words "$@")"
  else
    printf '+ %s\n' "$(quote_words "$@")" >&2
    "$@"
  fi
}

# --------------------------------------------------------------- the code

check_config() {  # CONFIG=FILE[:ARG], FILE relative to the repository root
  local file=${CONFIG%%:*}
  case $file in
    /*) die "CONFIG must be relative to the repository root (it is read on the workers from the copied package): got CONFIG=$CONFIG" ;;
  esac
  [[ -f $REPO_ROOT/$file ]] || die "CONFIG file $file not found under $REPO_ROOT (CONFIG=$CONFIG)"
}

make_tarball() {  # make_tarball OUT: the working tree (local edits included) as .tar.gz
  run_or_print tar -czf "$1" --exclude=.git --exclude=.venv --exclude='./workdir*' \
    --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache --exclude=./build \
    -C "$REPO_ROOT" .
}

remote_setup_command() {  # remote_setup_command JAX_SPEC [PIP_OPTION...]: unpack, venv, pip install
  # Ubuntu 22.04 images (TPU VMs) ship python3.10: install $PYTHON (and its venv
  # module) from apt when it is missing. One pip resolve for jax's accelerator
  # extra and the package, so that jax, jaxlib and the plugin/libtpu agree with
  # the package's jax pin.
  local pip="$VENV/bin/pip" jax_spec=$1
  shift
  printf '%s' "{ command -v $PYTHON && $PYTHON -c \"import ensurepip\"; } >/dev/null 2>&1" \
    " || { sudo apt-get update -qq && sudo apt-get install -y -qq $PYTHON $PYTHON-venv; }" \
    " && mkdir -p $REMOTE_PKG && tar -xzf ~/$REMOTE_TARBALL_NAME -C $REMOTE_PKG" \
    " && $PYTHON -m venv $VENV" \
    " && $pip install -q -U pip" \
    " && $pip install -q $(remote_words "$jax_spec") $REMOTE_PKG" \
    "${*:+ $(remote_words "$@")}"
}

remote_train_command() {  # remote_train_command LOG PIDFILE ENV_PREFIX TRAIN_FLAG...
  # cd into the package (CONFIG is relative to it) and start, under nohup in the
  # background with its own log, a loop that runs `t5x-like train` and runs it again
  # while it exits 143: stopped by SIGTERM (a preemption) after saving its checkpoint,
  # so the rerun resumes. Any other status (0 finished, 2 user error, 1 failure, 130
  # Ctrl-C) ends the loop. PIDFILE holds the loop's pid, PIDFILE.train the trainer's.
  local log=$1 pidfile=$2 env_prefix=$3
  shift 3
  local train loop
  train="${env_prefix}$VENV/bin/t5x-like train $(remote_words "$@")"
  loop="while :; do $train & echo \$! > $pidfile.train; wait \$!; rc=\$?;"
  loop+=" [ \$rc -eq 143 ] || exit \$rc;"
  loop+=" echo \"\$(date): t5x-like train stopped by SIGTERM (exit 143); resuming\"; done"
  printf '%s' "cd $REMOTE_PKG || exit 1; nohup bash -c $(remote_words "$loop")" \
    " > $log 2>&1 < /dev/null & echo \$! > $pidfile;" \
    " echo \"\$(hostname): started t5x-like train (rerun while it exits 143), pid \$!, log $log\""
}

remote_stop_command() {  # remote_stop_command PIDFILE
  # The restart loop first (so nothing reruns), then the trainer: SIGTERM, so it saves
  # a checkpoint at its current step and exits 143.
  printf '%s' "if [ -f $1 ] && kill \"\$(cat $1)\" 2>/dev/null;" \
    " then kill \"\$(cat $1.train)\" 2>/dev/null; echo \"\$(hostname): stopped\";" \
    " else echo \"\$(hostname): not running\"; fi; rm -f $1 $1.train"
}

# ------------------------------------------------------- supervised runs

# ssh's keepalive: a host that vanishes ends its worker's ssh with 255 within about a
# minute (a restart), instead of leaving the supervisor waiting on a dead connection.
# shellcheck disable=SC2034  # (used by gpu.sh)
SSH_KEEPALIVE=(-o ServerAliveInterval=15 -o ServerAliveCountMax=4)

remote_supervised_command() {  # remote_supervised_command LOG PIDFILE ENV_PREFIX TRAIN_FLAG...
  # In the foreground, for the supervisor's ssh: run `t5x-like train` once (its output
  # appended to LOG, its pid in PIDFILE for the stop and kill commands) and return its
  # exit status, which the supervisor decides on (launch/README.md, "Supervised runs").
  local log=$1 pidfile=$2 env_prefix=$3
  shift 3
  printf '%s' "cd $REMOTE_PKG || exit 1; echo \"\$(date): supervised start\" >> $log;" \
    " ${env_prefix}$VENV/bin/t5x-like train $(remote_words "$@") >> $log 2>&1 < /dev/null &" \
    " echo \$! > $pidfile; wait \$!; rc=\$?; rm -f $pidfile;" \
    " echo \"\$(date): t5x-like train exited \$rc\" >> $log; exit \$rc"
}

remote_signal_command() {  # remote_signal_command PIDFILE TERM|KILL: signal the supervised trainer
  printf '%s' "if [ -f $1 ] && kill -$2 \"\$(cat $1)\" 2>/dev/null;" \
    " then echo \"\$(hostname): sent SIG$2 to the trainer\";" \
    " else echo \"\$(hostname): not running\"; fi"
}

default_restart_delay() {  # seconds before a restart: past a URL workdir's lock going stale
  # A process 0 whose host vanished leaves workdir.lock behind; on a URL workdir its
  # heartbeat goes stale after 90 s (t5x_like/train/workdir_lock.py), and a restart before
  # that would be refused as a locked workdir (exit 2: the supervisor gives up).
  if [[ ${WORKDIR:-} == *://* ]]; then echo 100; else echo 30; fi
}

run_supervisor() {  # run_supervisor SUPERVISOR_FLAG...: the supervisor, on this machine
  # python3 -m t5x_like.host_loss.supervisor (stdlib only: nothing to install here). DRY_RUN=1
  # prints it, then runs its own dry run: the commands it would run, one restart
  # simulated (SIMULATE=PROCESS:STATUS, default process 1 killed: 1:137).
  local supervisor=(env PYTHONPATH="$REPO_ROOT" "${LOCAL_PYTHON:-python3}" -B -m t5x_like.host_loss.supervisor
    --max_restarts "${MAX_RESTARTS:-3}" --stop_grace_seconds "${STOP_GRACE_SECONDS:-60}"
    --restart_delay_seconds "${RESTART_DELAY_SECONDS:-$(default_restart_delay)}" "$@")
  run_or_print "${supervisor[@]}"
  if is_dry_run; then
    "${supervisor[@]}" --dry_run ${SIMULATE:+--simulate "$SIMULATE"} ||
      note "the supervisor would exit $?"
  fi
}

collect_extra_args() {  # EXTRA=(EXTRA_ARGS split on whitespace, then "$@")
  EXTRA=()
  read -r -a EXTRA <<<"${EXTRA_ARGS:-}" || true
  EXTRA+=("$@")
}
