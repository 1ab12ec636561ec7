# shellcheck shell=bash
# Settings and helpers shared by the tpu_scripts/*.sh commands (sourced, not run).
#
# Every setting is an environment variable with a default:
#   PROJECT          Google Cloud project              (default: gcloud's configured project)
#   ZONE             TPU zone                          (default: us-central2-b, where v4 slices live)
#   ACCELERATOR      accelerator type: v4-32, v5litepod-64, v4-8, ...   (default: v4-32)
#   TPU_NAME         name of the TPU VM / slice        (default: jaxrl-llm)
#   RUNTIME_VERSION  TPU software version              (default: tpu-ubuntu2204-base for v4 and older,
#                                                        v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv5 for v5p,
#                                                        v2-alpha-tpuv6e for v6e)
#   QUEUED           1: request the slice as a queued resource (recommended for large slices)
#   SPOT             1: a Spot (preemptible) slice
#   QR_NAME          queued-resource id when QUEUED=1  (default: $TPU_NAME-qr)
#   REMOTE_DIR       project folder on every worker, relative to the home directory (default: jaxrl_llm)

PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null || true)}
ZONE=${ZONE:-us-central2-b}
ACCELERATOR=${ACCELERATOR:-v4-32}
TPU_NAME=${TPU_NAME:-jaxrl-llm}
QUEUED=${QUEUED:-0}
SPOT=${SPOT:-0}
QR_NAME=${QR_NAME:-${TPU_NAME}-qr}
REMOTE_DIR=${REMOTE_DIR:-jaxrl_llm}
# The port JAX's TPU cluster detection uses for the coordinator service on worker 0.
COORDINATOR_PORT=${COORDINATOR_PORT:-8476}

default_runtime_version() {
  case "$1" in
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) echo "tpu-ubuntu2204-base" ;;
  esac
}
RUNTIME_VERSION=${RUNTIME_VERSION:-$(default_runtime_version "$ACCELERATOR")}

die() {
  echo "error: $*" >&2
  exit 1
}

log() {
  echo "[$(date -u +%H:%M:%S)] $*" >&2
}

require_project() {
  [ -n "$PROJECT" ] || die "set PROJECT (or run 'gcloud config set project ID')"
  command -v gcloud >/dev/null 2>&1 || die "gcloud is not installed (https://cloud.google.com/sdk/docs/install)"
}

# gcloud compute tpus SUBCOMMAND ... with the project and zone of this slice.
tpus() {
  gcloud compute tpus "$@" --project="$PROJECT" --zone="$ZONE"
}

# Runs a shell command on every worker of the slice at once (waits for all of them).
on_all_workers() {
  tpus tpu-vm ssh "$TPU_NAME" --worker=all --command="$1"
}

# The node's state (READY, CREATING, PREEMPTED, TERMINATED, ...) or NOT_FOUND.
node_state() {
  local state
  if ! state=$(tpus tpu-vm describe "$TPU_NAME" --format='value(state)' 2>/dev/null); then
    echo "NOT_FOUND"
    return 0
  fi
  echo "${state:-UNKNOWN}"
}

# The queued resource's state (WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDED, FAILED, ...) or NOT_FOUND.
queued_state() {
  local state
  if ! state=$(tpus queued-resources describe "$QR_NAME" --format='value(state.state)' 2>/dev/null); then
    echo "NOT_FOUND"
    return 0
  fi
  echo "${state:-UNKNOWN}"
}

# Internal IP of worker 0: JAX's coordinator runs there.
coordinator_address() {
  local ip
  ip=$(tpus tpu-vm describe "$TPU_NAME" --format='value(networkEndpoints[0].ipAddress)')
  [ -n "$ip" ] || die "no network endpoint for $TPU_NAME"
  echo "${ip}:${COORDINATOR_PORT}"
}
