#!/usr/bin/env bash
# Train on this machine: one torchrun, one process per GPU (or N CPU processes).
#
#   launch/single_node.sh                                   # all GPUs, or 2 CPU processes
#   launch/single_node.sh --nproc 4 -- --config configs/gsm8k.yaml --rollout.n 16
#
# Options:
#   --nproc N          processes (default: the GPUs nvidia-smi lists, else 2)
#   --max-restarts N   restart all workers up to N times after a crash; training resumes from
#                      the newest checkpoint in --trainer.output-dir (default: 0)
#   -h, --help         this text
# Everything after `--` goes to `python -m spmd_rl.train`. PYTHON picks the interpreter
# (default: python3). torchrun --standalone finds a free rendezvous port itself.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "single_node.sh: $*" >&2; echo "try: $0 --help" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
nproc=""
max_restarts=0
while [[ $# -gt 0 ]]; do
    case $1 in
    --nproc) [[ $# -ge 2 ]] || die "--nproc needs a value"; nproc=$2; shift 2 ;;
    --max-restarts) [[ $# -ge 2 ]] || die "--max-restarts needs a value"; max_restarts=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (training flags go after --)" ;;
    esac
done

if [[ -z $nproc ]]; then
    gpus=0
    if command -v nvidia-smi >/dev/null; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    nproc=$((gpus > 0 ? gpus : 2))
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$nproc'"
[[ $max_restarts =~ ^[0-9]+$ ]] || die "--max-restarts must be a non-negative integer, got '$max_restarts'"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    --max-restarts "$max_restarts" -m spmd_rl.train "$@"
