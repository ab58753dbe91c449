#!/usr/bin/env bash
# A Slurm cluster on this one machine, for tests: munged, slurmctld and slurmd, with config, key,
# sockets, state and logs under one directory.
#
#   tests/support/slurm_cluster.sh start DIR [NODES]    # NODES: 1 (default) or 2
#   tests/support/slurm_cluster.sh stop DIR
#
# `start` prints what a client needs: `SLURM_CONF=DIR/slurm.conf` and, with 2 nodes,
# `SLURM_NETNS=NAME`: run the clients there, e.g. `nsenter --net=/run/netns/NAME sbatch ...`.
#
# 1 node: this host (its short name, address 127.0.0.1); ports SPMD_RL_SLURMCTLD_PORT and
#   SPMD_RL_SLURMD_PORT (default 6817, 6818).
# 2 nodes: node1 and node2, each in a network namespace of its own joined by a veth pair
#   (10.99.0.1, 10.99.0.2), each with its own host name and an /etc/hosts naming both; the
#   controller runs on node1. Nothing is added to the host's own network. Needs `ip netns`,
#   nsenter and unshare.
# Each node advertises SPMD_RL_SLURM_CPUS CPUs (default 16, more than a small test machine has,
# accepted through SlurmdParameters=config_overrides) so several tasks fit on 2 cores. No cgroups
# (proctrack/linuxproc, task/none), no accounting. Needs root and the Debian packages slurmctld,
# slurmd, slurm-client and munge.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

cmd=${1:-}
dir=${2:-}
nodes=${3:-1}
case $cmd in
-h | --help) usage; exit 0 ;;
start | stop) [[ -n $dir ]] || { usage >&2; exit 2; } ;;
*) usage >&2; exit 2 ;;
esac
[[ $nodes == 1 || $nodes == 2 ]] || { echo "slurm_cluster: NODES must be 1 or 2, got '$nodes'" >&2; exit 2; }

cpus=${SPMD_RL_SLURM_CPUS:-16}

alive() {  # a zombie waiting to be reaped counts as gone
    [[ -e /proc/$1 ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

stop() {
    local f pid pids=() ns
    shopt -s nullglob
    for f in "$dir"/slurmd*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -f $f ]] || continue
        pid=$(cat "$f")
        rm -f "$f"
        if kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
    done
    shopt -u nullglob
    for _ in $(seq 100); do
        local running=0
        for pid in "${pids[@]}"; do if alive "$pid"; then running=1; fi; done
        ((running)) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    if [[ -f $dir/netns ]]; then  # deleting a namespace also deletes its end of the veth pair
        while read -r ns; do ip netns del "$ns" 2>/dev/null || true; done <"$dir/netns"
        rm -f "$dir/netns"
    fi
}

fail() {
    echo "slurm_cluster: $*" >&2
    shopt -s nullglob
    for log in "$dir"/*.log; do
        echo "--- $log" >&2
        grep -v 'pmix' "$log" | tail -n 20 >&2
    done
    stop
    exit 1
}

if [[ $cmd == stop ]]; then
    stop
    exit 0
fi

for bin in munged mungekey slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || fail "$bin not found (apt-get install slurmctld slurmd slurm-client munge)"
done
[[ $(id -u) == 0 ]] || fail "needs root (slurmd starts jobs as their user)"

stop
mkdir -p "$dir"/{munge,ctld}
chmod 755 "$dir/munge"

# munge: our own key, socket and seed; Slurm finds the socket through AuthInfo. A path socket
# works from every network namespace.
[[ -f $dir/munge/munge.key ]] || mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null 2>&1 \
    || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed" \
    || fail "munged did not start"

namespaces=()
if ((nodes == 1)); then
    names=("$(hostname -s)")
    addrs=(127.0.0.1)
    ctld_port=${SPMD_RL_SLURMCTLD_PORT:-6817}
    slurmd_port=${SPMD_RL_SLURMD_PORT:-6818}
else
    for bin in ip nsenter unshare; do
        command -v "$bin" >/dev/null || fail "2 nodes need ip (iproute2), nsenter and unshare; no $bin"
    done
    names=(node1 node2)
    addrs=(10.99.0.1 10.99.0.2)
    ctld_port=6817 slurmd_port=6818  # each node has its own network stack
    for i in 1 2; do
        ns="spmdslurm$$n$i"
        ip netns add "$ns" || fail "cannot make network namespace $ns"
        namespaces+=("$ns")
        echo "$ns" >>"$dir/netns"
    done
    ip -n "${namespaces[0]}" link add spmd0 type veth peer name spmd0 netns "${namespaces[1]}" \
        || fail "cannot make a veth pair between the namespaces"
    for i in 0 1; do
        ip -n "${namespaces[$i]}" addr add "${addrs[$i]}/24" dev spmd0
        ip -n "${namespaces[$i]}" link set spmd0 up
        ip -n "${namespaces[$i]}" link set lo up
    done
    printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${addrs[0]}" node1 "${addrs[1]}" node2 >"$dir/hosts"
fi
for name in "${names[@]}"; do mkdir -p "$dir/spool-$name"; done

{
    echo "# Written by tests/support/slurm_cluster.sh: $nodes node(s), no cgroups, no accounting."
    cat <<EOF
ClusterName=spmdrl
SlurmctldHost=${names[0]}(${addrs[0]})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s (instead of 2, 8, 32 s) while MinJobAge <= 4.
MinJobAge=4
EOF
    for i in "${!names[@]}"; do
        echo "NodeName=${names[$i]} NodeAddr=${addrs[$i]} CPUs=$cpus RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=test Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP"
} >"$dir/slurm.conf"
export SLURM_CONF=$dir/slurm.conf

# Run a command on node i: in its network namespace, with its host name and /etc/hosts (a mount
# and UTS namespace of its own; the daemons keep them, and so do the jobs they start).
on_node() {
    local i=$1
    shift
    if ((nodes == 1)); then
        "$@"
    else
        # shellcheck disable=SC2016  # expanded by the inner sh
        nsenter --net="/run/netns/${namespaces[$i]}" unshare --mount --uts \
            sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh \
            "$dir/hosts" "${names[$i]}" "$@"
    fi
}

# -i: ignore state left by an earlier cluster in this directory.
on_node 0 slurmctld -i -f "$SLURM_CONF" || fail "slurmctld did not start"
for i in "${!names[@]}"; do
    on_node "$i" slurmd -N "${names[$i]}" -f "$SLURM_CONF" || fail "slurmd did not start on ${names[$i]}"
done

states=""
for _ in $(seq 100); do
    states=$(on_node 0 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
    [[ $states == "idle " ]] && break
    sleep 0.2
done
[[ $states == "idle " ]] || fail "nodes ${names[*]} are '${states:-unreachable}', not idle, after 20 s"
echo "SLURM_CONF=$SLURM_CONF"
if ((nodes == 2)); then echo "SLURM_NETNS=${namespaces[0]}"; fi
