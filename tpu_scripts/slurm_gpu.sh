#!/usr/bin/env bash
# Multi-node GPU training under SLURM: one JAX process per node, each driving all of its node's GPUs.
#
#   sbatch --nodes=2 tpu_scripts/slurm_gpu.sh configs/paper/qwen2.5-math-7b_grpo.yaml train.mesh=fsdp=16
#
#SBATCH --job-name=jaxrl-llm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
#SBATCH --requeue
#SBATCH --signal=TERM@180
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: sbatch [--nodes=N] [--gpus-per-node=G] tpu_scripts/slurm_gpu.sh CONFIG.yaml [section.key=value ...]

Run from the project root on a shared filesystem where `bash scripts/setup.sh` has made .venv and
`.venv/bin/python -m pip install "jax[cuda12]==<the installed jax version>"` has added the CUDA runtime.
Every node runs `jaxrl-llm train --distributed --config CONFIG --resume ...` with
  JAX_COORDINATOR_ADDRESS  first node of the allocation, port derived from the job id
  JAX_NUM_PROCESSES        SLURM_NTASKS (one task per node)
  JAX_PROCESS_ID           SLURM_PROCID of the task
  JAX_LOCAL_DEVICE_IDS     0..G-1: each process uses every GPU of its node
--resume starts fresh when train.out_dir holds no checkpoint, so a requeued job (preemption, --requeue)
continues where it stopped; SLURM's TERM signal 180 s before the time limit makes the run save and exit.
Set train.mesh to cover every GPU of the job (e.g. fsdp=16 for 2 nodes x 8 GPUs).
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac

config=$1
shift
[ -f "$config" ] || { echo "error: config file $config not found (run from the project root)" >&2; exit 2; }
[ -x .venv/bin/jaxrl-llm ] || { echo "error: .venv/bin/jaxrl-llm missing: run bash scripts/setup.sh first" >&2; exit 2; }
: "${SLURM_JOB_ID:?submit with sbatch}"

gpus_per_node=${SLURM_GPUS_ON_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export JAX_COORDINATOR_ADDRESS="${head_node}:$((20000 + SLURM_JOB_ID % 20000))"
export JAX_NUM_PROCESSES="$SLURM_NTASKS"
JAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((gpus_per_node - 1)))
export JAX_LOCAL_DEVICE_IDS
export JAXRL_DISTRIBUTED=1
echo "coordinator $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES processes x $gpus_per_node GPUs"

# JAX_PROCESS_ID must be each task's own SLURM_PROCID: expand it inside the task, not here.
# shellcheck disable=SC2016
srun --kill-on-bad-exit=1 bash -c 'JAX_PROCESS_ID=$SLURM_PROCID exec .venv/bin/jaxrl-llm train --distributed "$@"' \
  jaxrl-llm --config "$config" --resume "$@"
