#!/bin/bash
# Multi-node training on Slurm: srun starts one torchrun per node; the torchruns meet in a c10d rendezvous hosted
# on the job's first node, then each starts one training process per GPU.
#
#   sbatch --nodes 4 scripts/slurm_grpo.sh --model Qwen/Qwen2.5-7B-Instruct --output-dir runs/qwen7b_gsm8k ...
#
# Submit from the repository root; the arguments go to grpo.py (TRAIN_SCRIPT=other.py sbatch ... runs another one).
# Keep --output-dir fixed: a requeued job resumes from the latest complete checkpoint there (--resume auto).
#
# Stopping without losing work: Slurm sends SIGTERM on preemption (to every process of the job, and torchrun passes
# it on again: one request), and every training process finishes its step, saves a checkpoint and exits
# (PET_SHUTDOWN_TIMEOUT below is how long torchrun waits before it kills them). Near the time limit, Slurm sends USR1
# to this script (--signal), which does the same and then requeues the job. A crashed worker (out of memory, kill -9)
# makes torchrun restart every worker, up to MAX_RESTARTS times, from the newest checkpoint. With MIN_NODES below the
# job's node count, the job goes on without a node that failed (torchrun's elastic launch; the run resumes on fewer
# ranks, which --prompts-per-step must still divide; submit with `sbatch --no-kill`, or Slurm ends the allocation
# with the node); the first node hosts the rendezvous and cannot be the one lost. Checkpoints must be on a
# filesystem every node sees.
#
#SBATCH --job-name=grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x_%j.out

set -euo pipefail

GPUS=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
MASTER_ADDR=${HOSTS[0]}
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Seconds torchrun waits between passing on SIGTERM and SIGKILL (its default, 30, is too short to finish a step and
# save). Also how long a crash on one rank can take to tear down the others: keep it near one step plus one save,
# and below the --signal lead time above.
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-300}
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES nodes x $GPUS GPUs," \
     "rendezvous at $MASTER_ADDR:$MASTER_PORT"

stop_and_requeue() {
    echo "time limit near: the run saves a checkpoint and stops, then the job is requeued"
    scancel --signal=TERM "$SLURM_JOB_ID"  # every task of the job step (not this script)
    wait "$TRAIN_PID" || true
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap stop_and_requeue USR1
# Preemption signals this script too: wait for the run to save instead of exiting (which would end the job now).
trap 'echo "SIGTERM: waiting for the run to save a checkpoint"; wait "$TRAIN_PID" || true; exit 143' TERM

MIN_NODES=${MIN_NODES:-$SLURM_NNODES}
# srun options in --name=value form. Unless the job may lose nodes, --kill-on-bad-exit stops every node when one
# fails, instead of a hang; if it may (submit with `sbatch --no-kill` too), --no-kill keeps the step on the others.
# torchrun's workers otherwise share one key-value store over all its restarts, and across nodes the restarts are
# not counted alike: a fresh store for every attempt (common/run/distributed.py's launch_store).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if [ "$MIN_NODES" = "$SLURM_NNODES" ]; then NODE_LOSS=(--kill-on-bad-exit=1); else NODE_LOSS=(--no-kill); fi
srun --ntasks-per-node=1 "${NODE_LOSS[@]}" \
    torchrun --nnodes "$MIN_NODES:$SLURM_NNODES" --nproc_per_node "$GPUS" --max-restarts "${MAX_RESTARTS:-3}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    "${TRAIN_SCRIPT:-grpo.py}" "$@" &
TRAIN_PID=$!
wait "$TRAIN_PID"  # in the background and waited for, so the traps above run as soon as a signal arrives
