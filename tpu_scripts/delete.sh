#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Deletes the slice (and its queued resource when QUEUED=1). Checkpoints on the workers' disks go with it:
# keep train.out_dir in the mounted bucket (install.sh BUCKET=...).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: [PROJECT=p] [ZONE=z] [TPU_NAME=n] [QUEUED=1] tpu_scripts/delete.sh

Deletes TPU_NAME, or with QUEUED=1 the queued resource QR_NAME and its node. Settings: tpu_scripts/common.sh.
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_project

if [ "$QUEUED" = "1" ]; then
  if [ "$(queued_state)" != "NOT_FOUND" ]; then
    log "deleting queued resource $QR_NAME and its node"
    tpus queued-resources delete "$QR_NAME" --force --quiet
  fi
elif [ "$(node_state)" != "NOT_FOUND" ]; then
  log "deleting $TPU_NAME"
  tpus tpu-vm delete "$TPU_NAME" --quiet
fi
