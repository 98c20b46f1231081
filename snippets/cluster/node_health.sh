#!/usr/bin/env bash
# Is this node fit to train on? Run it before a job starts on the node: by hand, or as the
# cluster's Slurm Prolog, which drains a node whose prolog exits non-zero and requeues the job.
#
#   snippets/cluster/node_health.sh [EXPECTED_GPUS]     DCGM_LEVEL=1|2|3 picks `dcgmi diag -r`
#
# It runs every check whose tool exists here and says which are missing. Exit status:
#   0  healthy
#   1  a check failed: drain the node (a pending row remap, a failed diagnostic, a port down...)
#   2  bad usage
#   3  no NVIDIA GPU here (no nvidia-smi, or it lists none): nothing to train on
set -uo pipefail

expected=${1:-}
level=${DCGM_LEVEL:-1}
if [[ -n $expected && ! $expected =~ ^[1-9][0-9]*$ ]] || [[ ! $level =~ ^[123]$ ]]; then
    echo "node_health: usage: node_health.sh [EXPECTED_GPUS >= 1], with DCGM_LEVEL 1, 2 or 3" \
         "(got '$expected', DCGM_LEVEL='$level')" >&2
    exit 2
fi
failed=0
gpus=ok    # ok, none (not a GPU node) or broken (a GPU node whose driver fails)
say() { echo "node_health: $*"; }
fail() { echo "node_health: FAIL: $*"; failed=1; }

# --8<-- [start:gpus]
if ! command -v nvidia-smi >/dev/null; then
    say "missing: nvidia-smi (no NVIDIA driver): no GPU checks, and no GPU to train on"
    gpus=none
elif ! list=$(nvidia-smi -L 2>&1); then
    fail "nvidia-smi cannot reach the driver: ${list%%$'\n'*}"
    gpus=broken
else
    count=$(grep -c '^GPU ' <<<"$list")
    say "$count GPU(s); the first: $(grep -m 1 '^GPU ' <<<"$list")"
    if [ "$count" -eq 0 ]; then
        gpus=none
    elif [ -n "$expected" ] && [ "$count" -ne "$expected" ]; then
        fail "$count GPUs visible, $expected expected: one has fallen off the bus (dmesg | grep -i xid)"
    fi
fi
# --8<-- [end:gpus]

# --8<-- [start:row-remapping]
# A row remap is recorded when a memory row goes bad, and takes effect at the next GPU reset:
# until then it is "pending". "Remapping Failure Occurred" means the spare rows ran out.
if [ "$gpus" = ok ]; then
    remapper=$(nvidia-smi -q -d ROW_REMAPPER)
    problems=$(awk '/^GPU /{gpu=$2}
                    /Pending *: *Yes/{print gpu ": row remapping pending: reset the GPU (nvidia-smi -r) before use"}
                    /Remapping Failure Occurred *: *Yes/{print gpu ": row remapping failed: replace the GPU"}' \
               <<<"$remapper")
    if [ -n "$problems" ]; then
        while read -r line; do fail "$line"; done <<<"$problems"
    else
        say "row remapping: nothing pending, no failures"
    fi
fi
# --8<-- [end:row-remapping]

# --8<-- [start:dcgm]
if [ "$gpus" != ok ]; then
    :  # nothing for DCGM to test
elif ! command -v dcgmi >/dev/null; then
    say "missing: dcgmi (NVIDIA DCGM is not installed): diagnostics skipped"
elif report=$(timeout 3600 dcgmi diag -r "$level" 2>&1); then
    say "dcgmi diag -r $level: passed"
else
    fail "dcgmi diag -r $level did not pass; its report ends:"
    tail -n 15 <<<"$report"
fi
# --8<-- [end:dcgm]

# --8<-- [start:infiniband]
# Each RDMA port's state, as the kernel reports it (/sys/class/infiniband/<hca>/ports/<n>/state
# holds e.g. "4: ACTIVE"); NCCL_IB_HCA names the adapters NCCL may use.
ports=(/sys/class/infiniband/*/ports/*/state)
if [ ! -e "${ports[0]}" ]; then
    say "missing: no InfiniBand or RoCE adapter (/sys/class/infiniband): NCCL would use TCP sockets"
else
    for port in "${ports[@]}"; do
        state=$(cat "$port")
        name=${port#/sys/class/infiniband/}
        name=${name%/state}
        if [[ $state == *ACTIVE* ]]; then
            say "${name/\/ports\// port }: $state"
        else
            fail "${name/\/ports\// port }: $state (expected ACTIVE)"
        fi
    done
fi
# --8<-- [end:infiniband]

if [ "$failed" -eq 1 ]; then
    say "UNHEALTHY: drain this node (exit 1)"
    exit 1
fi
if [ "$gpus" = none ]; then
    say "no NVIDIA GPU on this node (exit 3)"
    exit 3
fi
say "healthy (exit 0)"
