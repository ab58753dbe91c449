#!/usr/bin/env bash
# Train across several machines: run this once on every node, same flags except --node-rank.
#
#   node0$ launch/multi_node.sh --nnodes 2 --node-rank 0 --head node0:29500 -- --config configs/gsm8k.yaml
#   node1$ launch/multi_node.sh --nnodes 2 --node-rank 1 --head node0:29500 -- --config configs/gsm8k.yaml
#
# Options:
#   --nnodes N         number of nodes (required)
#   --node-rank R      this node, 0..N-1 (required); node 0 hosts the rendezvous and must be
#                      the machine named by --head
#   --head HOST[:PORT] address of node 0 that every node can reach (required; port 29500)
#   --nproc N          processes per node (default: the GPUs nvidia-smi lists, else 1)
#   --local-addr ADDR  this node's address as the others reach it (default: its host name;
#                      give it when host names do not resolve or to pick the network)
#   --rdzv-id ID       run id shared by all nodes (default: spmd_rl)
#   --static           static rendezvous (--master-addr/--master-port): global ranks follow
#                      --node-rank exactly; with the default c10d rendezvous torchrun orders
#                      nodes itself (sorted by host name) and may restart on a node failure
#   --max-restarts N   restart all workers up to N times after a crash; training resumes from
#                      the newest checkpoint (default: 0)
#   -h, --help         this text
# Everything after `--` goes to `python -m spmd_rl.train`. PYTHON picks the interpreter.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "multi_node.sh: $*" >&2; echo "try: $0 --help" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
nnodes="" node_rank="" head="" nproc="" local_addr="" rdzv_id=spmd_rl static=0 max_restarts=0
while [[ $# -gt 0 ]]; do
    case $1 in
    --nnodes | --node-rank | --head | --nproc | --local-addr | --rdzv-id | --max-restarts)
        [[ $# -ge 2 ]] || die "$1 needs a value"
        case $1 in
        --nnodes) nnodes=$2 ;;
        --node-rank) node_rank=$2 ;;
        --head) head=$2 ;;
        --nproc) nproc=$2 ;;
        --local-addr) local_addr=$2 ;;
        --rdzv-id) rdzv_id=$2 ;;
        --max-restarts) max_restarts=$2 ;;
        esac
        shift 2
        ;;
    --static) static=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (training flags go after --)" ;;
    esac
done

[[ -n $nnodes && -n $node_rank && -n $head ]] || die "--nnodes, --node-rank and --head are required"
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a positive integer, got '$nnodes'"
if ! [[ $node_rank =~ ^[0-9]+$ ]] || ((node_rank >= nnodes)); then
    die "--node-rank must be in 0..$((nnodes - 1)), got '$node_rank'"
fi
[[ $max_restarts =~ ^[0-9]+$ ]] || die "--max-restarts must be a non-negative integer, got '$max_restarts'"
if [[ $head == *:* ]]; then
    host=${head%:*} port=${head##*:}
else
    host=$head port=29500
fi
[[ -n $host && $port =~ ^[0-9]+$ ]] || die "--head must be HOST or HOST:PORT, got '$head'"
if [[ -z $nproc ]]; then
    gpus=0
    if command -v nvidia-smi >/dev/null; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    nproc=$((gpus > 0 ? gpus : 1))
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$nproc'"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
if ((static)); then
    rdzv=(--rdzv-backend static --master-addr "$host" --master-port "$port" --node-rank "$node_rank")
else
    # Node 0 hosts the rendezvous store; saying so explicitly works even when --head is an
    # alias or address that the node does not recognise as its own.
    is_host=$([[ $node_rank == 0 ]] && echo true || echo false)
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$host:$port" --rdzv-id "$rdzv_id" --rdzv-conf "is_host=$is_host")
fi
if [[ -n $local_addr ]]; then rdzv+=(--local-addr "$local_addr"); fi
exec "$PYTHON" -m torch.distributed.run --nnodes "$nnodes" --nproc-per-node "$nproc" "${rdzv[@]}" \
    --max-restarts "$max_restarts" \
    -m spmd_rl.train "$@"
