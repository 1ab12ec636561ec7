#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Creates a TPU VM or pod slice and waits until every worker is READY.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: [PROJECT=p] [ZONE=z] [ACCELERATOR=v4-32] [TPU_NAME=n] [QUEUED=1] [SPOT=1] tpu_scripts/create.sh

Creates the slice TPU_NAME of type ACCELERATOR (one TPU VM per host; a v4-32 has 4 hosts, a
v5litepod-64 has 16) with RUNTIME_VERSION. QUEUED=1 requests it as a queued resource QR_NAME and
waits in the queue; SPOT=1 asks for Spot capacity (cheaper, preemptible: see run_preemptible.sh).
Settings: tpu_scripts/common.sh.
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_project

spot_flag=()
if [ "$SPOT" = "1" ]; then spot_flag=(--spot); fi

wait_until_ready() {
  local state
  while true; do
    state=$(node_state)
    case "$state" in
      READY) log "$TPU_NAME is READY"; return 0 ;;
      PREEMPTED|TERMINATED|FAILED) die "$TPU_NAME is $state" ;;
      *) log "$TPU_NAME: $state; waiting"; sleep 30 ;;
    esac
  done
}

if [ "$QUEUED" = "1" ]; then
  log "requesting queued resource $QR_NAME: node $TPU_NAME, $ACCELERATOR, $RUNTIME_VERSION"
  tpus queued-resources create "$QR_NAME" --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR" \
    --runtime-version="$RUNTIME_VERSION" "${spot_flag[@]}"
  while true; do
    state=$(queued_state)
    case "$state" in
      ACTIVE) break ;;
      FAILED|SUSPENDED) die "queued resource $QR_NAME is $state (see: gcloud compute tpus queued-resources describe $QR_NAME)" ;;
      *) log "$QR_NAME: $state; waiting"; sleep 60 ;;
    esac
  done
else
  log "creating $TPU_NAME: $ACCELERATOR, $RUNTIME_VERSION"
  tpus tpu-vm create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$RUNTIME_VERSION" "${spot_flag[@]}"
fi
wait_until_ready
