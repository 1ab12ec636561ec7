#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Keeps a training run going on a preemptible (Spot) slice: launch, and whenever the slice is preempted,
# recreate it, reinstall and relaunch with --resume from the latest checkpoint, until the run finishes.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: CONFIG=configs/paper/qwen2.5-math-1.5b_gvm_raftpp.yaml BUCKET=my-bucket [SPOT=1] [QUEUED=1] \
         [MAX_RESTARTS=20] tpu_scripts/run_preemptible.sh [section.key=value ...]

Loop: make sure the slice is READY (create it, or delete and recreate it when PREEMPTED, TERMINATED,
SUSPENDED or FAILED, then run install.sh); run launch.sh --resume with the overrides; stop when the
workers exit 0 and the run was not interrupted (no "SIGTERM: saved step" in this attempt's output).
A failure on a healthy slice is retried too; after MAX_RESTARTS attempts the script gives up.
Checkpoints must outlive the slice: keep train.out_dir (and model.source, the data files) under the
bucket mount, e.g. train.out_dir=/mnt/gcs/runs/gvm_raftpp_1.5b. Settings: tpu_scripts/common.sh,
create.sh, install.sh, launch.sh.
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac

here=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=common.sh
source "$here/common.sh"
require_project
: "${CONFIG:?set CONFIG to a preset path, e.g. configs/paper/qwen2.5-math-1.5b_grpo.yaml}"
MAX_RESTARTS=${MAX_RESTARTS:-20}
RETRY_SLEEP=${RETRY_SLEEP:-60}

slice_state() {
  if [ "$QUEUED" = "1" ]; then
    case "$(queued_state)" in
      SUSPENDING|SUSPENDED|FAILED) echo "SUSPENDED"; return 0 ;;
      NOT_FOUND) echo "NOT_FOUND"; return 0 ;;
    esac
  fi
  node_state
}

ensure_slice() {
  local state
  state=$(slice_state)
  case "$state" in
    READY)
      if ! on_all_workers "test -x ~/$(printf "%q" "$REMOTE_DIR")/.venv/bin/jaxrl-llm"; then "$here/install.sh"; fi
      return 0 ;;
    PREEMPTED|TERMINATED|SUSPENDED|FAILED|STOPPED) log "$TPU_NAME is $state: recreating"; "$here/delete.sh" ;;
    NOT_FOUND) log "$TPU_NAME does not exist: creating" ;;
    *) log "$TPU_NAME is $state: waiting"; sleep "$RETRY_SLEEP"; ensure_slice; return 0 ;;
  esac
  "$here/create.sh"
  "$here/install.sh"
}

attempt=0
while true; do
  attempt=$((attempt + 1))
  [ "$attempt" -le "$MAX_RESTARTS" ] || die "gave up after $MAX_RESTARTS attempts"
  ensure_slice
  attempt_log=$(mktemp)
  log "attempt $attempt"
  status=0
  LOG="$attempt_log" "$here/launch.sh" --resume "$@" || status=$?
  cat "$attempt_log" >> "${LOG:-${TPU_NAME}-train.log}"
  interrupted=0
  if grep -q "SIGTERM: saved step" "$attempt_log"; then interrupted=1; fi
  rm -f "$attempt_log"
  if [ "$status" -eq 0 ] && [ "$interrupted" -eq 0 ]; then
    log "training finished"
    exit 0
  fi
  log "attempt $attempt ended (exit status $status, interrupted=$interrupted); slice is $(slice_state)"
  sleep "$RETRY_SLEEP"
done
