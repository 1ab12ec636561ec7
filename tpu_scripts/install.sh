#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Installs jaxrl_llm on every worker of the slice: the code (git clone, or this checkout's HEAD),
# Python 3.11, `bash scripts/setup.sh`, JAX's TPU runtime, and optionally a Cloud Storage bucket mounted
# at the same path on every worker for models, data and checkpoints.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: [TPU_NAME=n ...] [REPO_URL=url [GIT_REF=ref]] [BUCKET=b [MOUNT_POINT=/mnt/gcs]] tpu_scripts/install.sh

Code: with REPO_URL every worker clones it and checks out GIT_REF (default: main); without it, this
checkout's committed HEAD is packed with `git archive` and copied to every worker (uncommitted changes
are not sent). Then on every worker: python3.11 from apt when missing, `bash scripts/setup.sh` (a .venv with
jaxrl_llm and the bundled model) and `jax[tpu]` at the version setup.sh installed.
PYTHON_BIN (default python3.11) must be a final release >= 3.11; when apt has none, install one (deadsnakes,
uv) and point PYTHON_BIN at it.
BUCKET: mounts gs://BUCKET with gcsfuse at MOUNT_POINT on every worker. A preempted slice loses its disks,
so put train.out_dir (checkpoints, metrics), model.source and the data files under MOUNT_POINT.
Settings: tpu_scripts/common.sh.
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_project
REPO_URL=${REPO_URL:-}
GIT_REF=${GIT_REF:-main}
BUCKET=${BUCKET:-}
MOUNT_POINT=${MOUNT_POINT:-/mnt/gcs}
PYTHON_BIN=${PYTHON_BIN:-python3.11}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

dir_q=$(printf '%q' "$REMOTE_DIR")
if [ -n "$REPO_URL" ]; then
  log "cloning $REPO_URL@$GIT_REF on every worker"
  on_all_workers "rm -rf ~/$dir_q && git clone -q $(printf '%q' "$REPO_URL") ~/$dir_q \
    && git -C ~/$dir_q checkout -q $(printf '%q' "$GIT_REF")"
else
  archive=$(mktemp --suffix=.tar.gz)
  trap 'rm -f "$archive"' EXIT
  git -C "$ROOT" archive --format=tar.gz -o "$archive" HEAD
  log "copying $(git -C "$ROOT" rev-parse --short HEAD) to every worker"
  tpus tpu-vm scp "$archive" "$TPU_NAME:jaxrl_llm_src.tar.gz" --worker=all
  on_all_workers "rm -rf ~/$dir_q && mkdir -p ~/$dir_q && tar -xzf ~/jaxrl_llm_src.tar.gz -C ~/$dir_q \
    && rm ~/jaxrl_llm_src.tar.gz"
fi

py_q=$(printf '%q' "$PYTHON_BIN")
log "installing on every worker ($PYTHON_BIN, scripts/setup.sh, jax[tpu])"
on_all_workers "set -e
if ! command -v $py_q >/dev/null; then
  sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py_q $py_q-venv
fi
cd ~/$dir_q
PYTHON=$py_q bash scripts/setup.sh
jax_version=\$(.venv/bin/python -c 'import jax; print(jax.__version__)')
.venv/bin/python -m pip install -q \"jax[tpu]==\$jax_version\""

if [ -n "$BUCKET" ]; then
  mount_q=$(printf '%q' "$MOUNT_POINT")
  log "mounting gs://$BUCKET at $MOUNT_POINT on every worker"
  on_all_workers "set -e
if ! command -v gcsfuse >/dev/null; then
  echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" \
    | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcsfuse
fi
sudo mkdir -p $mount_q && sudo chown \"\$USER\" $mount_q
mountpoint -q $mount_q || gcsfuse --implicit-dirs $(printf '%q' "$BUCKET") $mount_q"
fi
log "installed on every worker of $TPU_NAME"
