#!/usr/bin/env bash
# SLURM launch: one jaxserve process per node, all GPUs of the node visible to it.
#
#   sbatch --nodes=2 scripts/launch_slurm.sh jaxserve serve --model /shared/Qwen3-30B-A3B --mesh dp=2,tp=8
#
# srun starts one task per node; jaxserve.distributed.resolve reads SLURM_NTASKS and
# SLURM_PROCID, and the coordinator is the first node of the allocation (port
# JAXSERVE_COORDINATOR_PORT, default 61234; the step channel uses the next two).
# Process 0 (on the first node) schedules and serves gRPC; the others follow it.
#SBATCH --job-name=jaxserve
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=jaxserve-%j-%t.log
set -euo pipefail

[[ $# -gt 0 ]] || { echo "usage: sbatch [--nodes=N] $0 CMD [ARGS...]" >&2; exit 2; }
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export JAX_COORDINATOR_ADDRESS="${head_node}:${JAXSERVE_COORDINATOR_PORT:-61234}"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$@"
