#!/usr/bin/env bash
# A real SLURM cluster with two nodes, node1 and node2, on this one machine.
#
#   snippets/cluster/local_slurm.sh start    install slurm-wlm and munge if missing (root + apt-get),
#                                            write the config, start munged, slurmctld and two
#                                            slurmd, wait until both nodes are idle
#   eval "$(snippets/cluster/local_slurm.sh env)"   point sbatch, squeue, sinfo... at it
#   snippets/cluster/local_slurm.sh status   sinfo and squeue
#   snippets/cluster/local_slurm.sh stop     shut every daemon down
#
# Both nodes are this machine: two slurmd daemons, `slurmd -N node1` and `slurmd -N node2`, each
# listening on its own port (17001, 17002), both with NodeHostname=localhost. The names node1 and
# node2 exist only inside SLURM: they do not resolve to an address, so a job that needs a host to
# connect to (torchrun's MASTER_ADDR) uses 127.0.0.1. All state, logs and the munge key live in
# $LOCAL_SLURM_DIR (default /tmp/course-slurm-USER, one per user: `start` clears its own job state
# there, and must not meet another user's); nothing is written to /etc.
#
# Exit status of `start`: 0 running, 3 SLURM is not installed and cannot be installed here,
# 1 anything else (the daemons' logs are printed).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # where Debian puts slurmctld, slurmd and munged

STATE=${LOCAL_SLURM_DIR:-/tmp/course-slurm-$(id -un)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONF=$STATE/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-16817}

log() { echo "local_slurm: $*" >&2; }

# --8<-- [start:install]
install_if_missing() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged \
        >/dev/null && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        log "slurm-wlm and munge are not installed; install them as root, e.g." \
            "\`sudo apt-get install slurm-wlm munge\` (Debian/Ubuntu)"
        exit 3
    fi
    log "installing slurm-wlm and munge with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurm-wlm munge >/dev/null; }; then
        log "apt-get could not install slurm-wlm and munge (no network or no package source?)"
        exit 3
    fi
}
# --8<-- [end:install]

write_config() {
    mkdir -p "$STATE"/{munge,ctld,spool,run,log}
    # Readable, not writable, by others: users other than the daemons' must reach the socket.
    chmod 755 "$STATE" "$STATE/munge" "$STATE/log"
    if [ ! -s "$STATE/munge/munge.key" ]; then
        # munge signs every message between SLURM daemons and commands with this shared key;
        # on a real cluster every node holds a copy of the same key.
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$STATE/munge/munge.key"
    fi
    local user controller last_job
    user=$(id -un)
    controller=$(hostname -s)
    # The course's batch scripts write runs/slurm/<job id>/ under the repository, and `start`
    # clears the job state, so a new cluster would number from 1 again: go on from the
    # highest id already there (a real cluster never reuses an id either).
    last_job=$(ls "$REPO/runs/slurm" 2>/dev/null | grep -Ex '[0-9]+' | sort -n | tail -n 1 || true)
    # --8<-- [start:slurm-conf]
    cat >"$CONF" <<EOF
ClusterName=course
SlurmctldHost=$controller(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=$user
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroups in a container: track a job's processes by their parent links (linuxproc), no
# CPU binding. Not by process group (pgid): torchrun starts each worker in a session of its
# own, so a signal to torchrun's group would miss the workers, and a step killed at its time
# limit would leave them running.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# Hand out CPUs, not whole nodes; trust the CPU counts below even if this machine has fewer.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
# Job ids go on from the highest runs/slurm/<id> of the repository: never one used before.
FirstJobId=$(( ${last_job:-0} + 1 ))
# No slurmdbd database, so no sacct: finished jobs are listed in a plain-text log instead
# (and scontrol show job keeps them for MinJobAge seconds).
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
MinJobAge=600
# Two slurmd on one host: same NodeHostname, different ports. NodeAddr is how slurmctld
# reaches each one; without it, it would look up "node1" in DNS and fail.
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 CPUs=2 State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=30 State=UP
EOF
    # --8<-- [end:slurm-conf]
}

running() {  # is the daemon whose pid file is $1 alive?
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

print_logs() {
    for f in "$STATE"/log/*.log; do
        [ -f "$f" ] && { log "--- $f (last lines)"; tail -n 15 "$f" >&2; }
    done
}

start() {
    install_if_missing
    if running "$STATE/run/slurmctld.pid"; then
        log "already running (state in $STATE)"
    else
        if [ -d "$STATE" ] && [ -n "$(ls -A "$STATE")" ] && [ ! -e "$CONF" ]; then
            log "error: $STATE holds files this script did not write; set LOCAL_SLURM_DIR to" \
                "an empty or new folder"
            return 1
        fi
        rm -rf "$STATE/ctld" "$STATE/log" "$STATE/spool"  # a fresh cluster (ids: FirstJobId)
        write_config
        export SLURM_CONF=$CONF
        # --8<-- [start:daemons]
        running "$STATE/munge/munged.pid" || munged --force --socket="$MUNGE_SOCKET" \
            --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge/munged.pid" \
            --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"
        slurmctld -c              # -c: clear any job state an earlier run left behind
        slurmd -N node1           # one slurmd per node; -N says which node of slurm.conf it is
        slurmd -N node2
        # --8<-- [end:daemons]
    fi
    export SLURM_CONF=$CONF
    local deadline=$((SECONDS + 60))
    until [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" -eq 2 ]; do
        if [ $SECONDS -ge $deadline ]; then
            log "the nodes did not become idle within 60 s:"
            sinfo -N >&2 || true
            print_logs
            exit 1
        fi
        sleep 0.5
    done
    log "running: node1 and node2 idle; state, logs and job completion log in $STATE"
}

stop() {
    export SLURM_CONF=$CONF
    if running "$STATE/run/slurmctld.pid"; then
        scontrol shutdown >/dev/null 2>&1 || true  # slurmctld tells every slurmd to exit, then exits
    fi
    local pidfile deadline=$((SECONDS + 15))
    for pidfile in "$STATE"/run/*.pid; do  # wait for the shutdown, then insist
        [ -s "$pidfile" ] || continue
        while running "$pidfile" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        running "$pidfile" && kill -TERM "$(cat "$pidfile")" 2>/dev/null
        rm -f "$pidfile"
    done
    if running "$STATE/munge/munged.pid"; then
        pid=$(cat "$STATE/munge/munged.pid")
        kill -TERM "$pid"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    status) export SLURM_CONF=$CONF; sinfo -N; squeue ;;
    *) echo "usage: $0 start|stop|env|status" >&2; exit 2 ;;
esac
