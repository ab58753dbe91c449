#!/usr/bin/env bash
# Check a planned world before you submit: print every rank's node, local rank, pools and mesh
# coordinates, or fail with the trainer's own message. Starts no processes, needs no GPU.
#
#   launch/check_layout.sh --nnodes 2 --nproc 8 -- --config configs/gsm8k.yaml --actor.fsdp.fsdp-size 8
#   launch/check_layout.sh --world-size 16 --nproc 8 --json -- --config configs/gsm8k.yaml --actor.engine megatron \
#       --actor.megatron.tp 2 --model.path /models/Qwen2.5-7B-Instruct
#
# Options:
#   --nnodes N       nodes of the planned run (default: 1)
#   --nproc N        processes (GPUs) per node (default: 8)
#   --world-size W   total processes (default: nnodes x nproc)
#   --json           one JSON object instead of tables
#   -h, --help       this text
# Everything after `--` is the training flags you will launch with. PYTHON picks the interpreter.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "check_layout.sh: $*" >&2; echo "try: $0 --help" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
nnodes=1 nproc=8 world="" json=()
while [[ $# -gt 0 ]]; do
    case $1 in
    --nnodes | --nproc | --world-size)
        [[ $# -ge 2 ]] || die "$1 needs a value"
        [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
        case $1 in
        --nnodes) nnodes=$2 ;;
        --nproc) nproc=$2 ;;
        --world-size) world=$2 ;;
        esac
        shift 2
        ;;
    --json) json=(--json); shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (training flags go after --)" ;;
    esac
done
world=${world:-$((nnodes * nproc))}

exec "$PYTHON" -m spmd_rl.layout --world-size "$world" --nproc-per-node "$nproc" "${json[@]}" "$@"
