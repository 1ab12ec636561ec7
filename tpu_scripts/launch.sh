#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Runs the same `jaxrl-llm train --distributed` on every worker of the slice (one JAX process per host)
# and waits for it; the output of all workers is streamed here and appended to a local log.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: CONFIG=configs/paper/qwen2.5-math-1.5b_gvm_raftpp.yaml [TPU_NAME=n ...] [LOG=file] \
         tpu_scripts/launch.sh [--resume] [section.key=value ...]

Every worker runs, in ~/REMOTE_DIR:
  JAXRL_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=<worker 0 IP>:8476 \
    .venv/bin/jaxrl-llm train --distributed --config CONFIG [--resume] [section.key=value ...]
jax.distributed.initialize() takes the coordinator from JAX_COORDINATOR_ADDRESS and finds the process count
and each worker's process id from the TPU metadata. A process left over from an earlier launch (its pid is
kept in ~/REMOTE_DIR/train.pid) is stopped first. --resume continues from the latest checkpoint in
train.out_dir (a fresh start when there is none). Exit status: that of the workers' command.
Settings: tpu_scripts/common.sh.
USAGE
}
resume=()
overrides=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --resume) resume=(--resume) ;;
    *=*) overrides+=("$arg") ;;
    *) usage >&2; echo "error: unexpected argument '$arg' (overrides are section.key=value)" >&2; exit 2 ;;
  esac
done

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_project
CONFIG=${CONFIG:?set CONFIG to a preset path relative to the project root, e.g. configs/paper/qwen2.5-math-1.5b_grpo.yaml}
LOG=${LOG:-${TPU_NAME}-train.log}

coordinator=$(coordinator_address)
dir_q=$(printf '%q' "$REMOTE_DIR")
train_args=$(printf '%q ' --config "$CONFIG" "${resume[@]}" "${overrides[@]}")
remote="cd ~/$dir_q || exit 1
if [ -f train.pid ]; then kill \$(cat train.pid) 2>/dev/null && sleep 20; rm -f train.pid; fi
echo \$\$ > train.pid
export JAXRL_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=$(printf '%q' "$coordinator")
exec .venv/bin/jaxrl-llm train --distributed $train_args"

log "launching on every worker of $TPU_NAME (coordinator $coordinator): jaxrl-llm train --distributed $train_args"
log "output: $LOG"
on_all_workers "$remote" 2>&1 | tee -a "$LOG"
