#!/usr/bin/env bash
# Every GPU figure of docs/speed.md in one call on a GPU host: `t5x-like bench gpu`
# (t5x_like/speed/gpu_suite.py) with what that host lacks installed from carried wheels.
#
#   OUT=/tmp/out launch/gpu_bench.sh                  # the call (budget 540 s)
#   OUT=/tmp/out launch/gpu_bench.sh --rehearse       # the same steps on this CPU
#   launch/gpu_bench.sh --list                        # the steps, in order
#
# Flags after the script go to `t5x-like bench gpu` (--budget, --only, --rehearse, ...).
# The host may have jax, torch and transformers but not the project's smaller
# dependencies: those that do not import are installed from WHEELS (default: .whl in the
# repository, filled once as docs/speed.md says) into a temporary folder on
# PYTHONPATH; nothing is installed into the host's Python. The project runs from this
# checkout (PYTHONPATH), not from an install. OUT ends with at most 4 files:
# results.json, summary.md, log.txt, traces.tar.gz; the summary is printed too.
set -euo pipefail

PROG=gpu_bench.sh
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: OUT=DIR launch/gpu_bench.sh [t5x-like bench gpu flags]

variables (defaults in brackets):
  OUT      [required unless --list] an empty folder for the results
  WHEELS   [REPO/.whl] wheels of the modules this host lacks
  PYTHON   [python3] the host's Python with jax (and torch, transformers)
  COMMIT   [git rev-parse --short HEAD, where the tree is a checkout] recorded in results
EOF
}

# module to import -> the wheel that provides it
MODULES="grain array_record portpicker ml_collections tensorboardX"

install_missing() {  # install_missing PYTHON: missing modules from WHEELS, on PYTHONPATH
  local python=$1 missing=() module site
  for module in $MODULES; do
    "$python" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
  done
  ((${#missing[@]})) || return 0
  local wheels=${WHEELS:-$REPO_ROOT/.whl}
  compgen -G "$wheels/*.whl" >/dev/null ||
    die "missing modules (${missing[*]}) and no wheels in $wheels (docs/speed.md: carry them)"
  site=$(mktemp -d)
  note "installing ${missing[*]} from $wheels into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

main() {
  local python=${PYTHON:-python3} arg listing=0
  for arg in "$@"; do
    case $arg in
      -h | --help) usage; return 0 ;;
      --list) listing=1 ;;
    esac
  done
  ((listing)) || [[ -n ${OUT:-} ]] || usage_error "OUT is required: an empty folder for the results"
  [[ ${OUT:-/} == /* ]] || OUT=$PWD/$OUT  # the command runs from the repository root
  export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  install_missing "$python"
  local commit=${COMMIT:-$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || true)}
  cd "$REPO_ROOT"
  if ((listing)); then
    exec "$python" -m t5x_like.cli bench gpu "$@"
  fi
  exec "$python" -m t5x_like.cli bench gpu --out "$OUT" --commit "$commit" "$@"
}

main "$@"
