#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for the tests and for trying the batch scripts.
#
# Usage: scripts/slurm/local_cluster.sh start|stop|status
#
#   start   installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, writes a
#           slurm.conf for this host under the scratch folder, starts munged (unless a munge daemon
#           already answers), slurmctld and slurmd, and waits until the node is idle. Idempotent: a
#           daemon that is already running is left as it is. Prints the path of slurm.conf as the last
#           line of stdout: clients find the cluster with `export SLURM_CONF=<that path>`.
#   stop    cancels the cluster's jobs, then stops each daemon this script started, by the PID in its
#           pid file (never by name: another munged or slurmd on the machine is not ours to stop).
#   status  prints the daemons' PIDs and, with slurmctld running, `sinfo`; exit code 0 when the node answers.
#
# Environment:
#   LOCAL_SLURM_DIR    scratch folder for slurm.conf, state, spool, logs, pid files
#                      (default <repo>/.tools/slurm, git-ignored)
#   LOCAL_SLURM_CPUS   CPUs the node claims (default: the machine's, at least 8). slurmd accepts more
#                      than the machine has (SlurmdParameters=config_overrides), so jobs that ask for
#                      several tasks or CPUs run on a small CI machine; they only share its cores.
#
# Runs as root (it installs packages and starts daemons), without systemd. It rests on directives that
# work with Slurm 22.05, the daemons' start order, and munge running as the munge user
# (tests/test_slurm.py runs it).
set -euo pipefail

log() { printf 'local_cluster: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
scratch="${LOCAL_SLURM_DIR:-$repo_root/.tools/slurm}"
conf="$scratch/slurm.conf"
ctld_pid="$scratch/slurmctld.pid"
slurmd_pid="$scratch/slurmd.pid"
# munged keeps its pid file in /run/munge; this marker says that this script started that munged,
# so `stop` stops only a munged it started.
munge_marker="$scratch/munged.started"
munge_pid=/run/munge/munged.pid
packages=(slurmctld slurmd slurm-client munge)
host="$(hostname -s)"
export SLURM_CONF="$conf"

need_root() { [[ $(id -u) -eq 0 ]] || die "run as root: $1"; }

# PID from a pid file when that process is alive and is the named program (a stale pid file whose
# number was reused by another process must not be taken for the daemon).
live_pid() {
    local file=$1 name=$2 pid
    [[ -r $file ]] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    [[ -n $pid && -r /proc/$pid/comm ]] || return 1
    [[ "$(cat "/proc/$pid/comm")" == "$name" ]] || return 1
    printf '%s\n' "$pid"
}

install_packages() {
    local missing=() pkg
    for pkg in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    need_root "installing ${missing[*]}"
    log "installing ${missing[*]} (apt-get, --no-install-recommends)"
    # The packages' maintainer scripts would start the daemons before a slurm.conf exists (and without
    # systemd that fails the install): a policy-rc.d that answers 101 tells them not to, for the
    # duration of the install only. A policy the machine already has is left alone.
    local policy=/usr/sbin/policy-rc.d temp_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        temp_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    # The package lists of a fresh machine are stale or absent: update first, only when installing.
    # dpkg's chatter goes to a log, shown when something fails.
    mkdir -p "$scratch"
    local apt_log="$scratch/apt.log"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >"$apt_log" 2>&1; then
        tail -n 30 "$apt_log" >&2
        die "installing ${missing[*]} failed (whole log: $apt_log)"
    fi
    if ((temp_policy)); then
        rm -f "$policy"
        trap - EXIT
    fi
}

# The node's memory as slurm counts it: MemTotal in MB, less 10% (at least 512 MB) of headroom, so
# a job asking for "all" memory does not starve the daemons.
real_memory_mb() {
    local total_kb total_mb headroom
    total_kb="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)"
    total_mb=$((total_kb / 1024))
    headroom=$((total_mb / 10 > 512 ? total_mb / 10 : 512))
    printf '%s\n' $((total_mb - headroom))
}

write_conf() {
    local cpus="${LOCAL_SLURM_CPUS:-}"
    if [[ -z $cpus ]]; then
        cpus="$(nproc)"
        ((cpus >= 8)) || cpus=8
    fi
    [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_CPUS=$cpus is not a positive number"
    mkdir -p "$scratch/state" "$scratch/spool"
    # Written anew on every start, so a changed machine (memory, hostname) or setting takes effect.
    cat >"$conf.tmp" <<EOF
# Written by scripts/slurm/local_cluster.sh: a one-node cluster for tests. Edit the script, not this.
ClusterName=autotuner-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$scratch/state
SlurmdSpoolDir=$scratch/spool
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$scratch/slurmctld.log
SlurmdLogFile=$scratch/slurmd.log
# No cgroups on a CI machine: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
# Finished jobs stay visible to squeue (there is no accounting, so no sacct).
MinJobAge=4
KillWait=5
MailProg=/bin/true
# A request the node can never satisfy is refused at submission instead of pending forever.
EnforcePartLimits=ALL
# The node may claim more CPUs than the machine has (see LOCAL_SLURM_CPUS above).
SlurmdParameters=config_overrides
NodeName=$host CPUs=$cpus RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$conf.tmp" "$conf"
}

ensure_hostname_resolves() {
    getent hosts "$host" >/dev/null && return 0
    log "adding '127.0.0.1 $host' to /etc/hosts (slurm resolves its own host name)"
    printf '127.0.0.1 %s\n' "$host" >>/etc/hosts
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_works && return 0
    # Without systemd nothing creates the runtime folder; munged runs as the munge user and wants
    # its socket folder owned by that user.
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$munge_marker"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_works && return 0
        sleep 0.2
    done
    die "munged started but 'munge -n | unmunge' does not work (see /var/log/munge/munged.log)"
}

node_state() { sinfo -h -o %T 2>/dev/null | head -n 1; }

wait_for_idle() {
    local i state=""
    for ((i = 0; i < 120; i++)); do
        state="$(node_state)"
        case "$state" in
        idle | mixed | allocated) return 0 ;;
        esac
        sleep 0.5
    done
    log "slurmctld.log:"
    tail -n 20 "$scratch/slurmctld.log" >&2 || true
    log "slurmd.log:"
    tail -n 20 "$scratch/slurmd.log" >&2 || true
    die "the node did not become idle within 60 s (state: '${state:-no answer}')"
}

start() {
    need_root "the daemons run as root"
    install_packages
    ensure_hostname_resolves
    write_conf
    start_munge
    if live_pid "$ctld_pid" slurmctld >/dev/null; then
        log "slurmctld already running"
    else
        # -i: ignore unreadable state left by an earlier cluster; the state itself is kept, so job
        # ids keep counting up and never reuse an earlier job's run directory name.
        /usr/sbin/slurmctld -i -f "$conf"
    fi
    if live_pid "$slurmd_pid" slurmd >/dev/null; then
        log "slurmd already running"
    else
        /usr/sbin/slurmd -f "$conf"
    fi
    wait_for_idle
    log "node $host is $(node_state); clients need: export SLURM_CONF=$conf"
    printf '%s\n' "$conf"
}

# TERM, then KILL after 10 s; by PID only.
stop_pid() {
    local pid=$1 name=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 50; i++)); do
        [[ -e /proc/$pid ]] || {
            log "stopped $name ($pid)"
            return 0
        }
        sleep 0.2
    done
    log "$name ($pid) ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

stop() {
    local pid
    # Jobs first, while slurmctld and slurmd can still end them: a job step outlives a killed slurmd.
    if live_pid "$ctld_pid" slurmctld >/dev/null && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
        scancel --full --quiet --partition=debug 2>/dev/null || true
        sleep 1
    fi
    if pid="$(live_pid "$slurmd_pid" slurmd)"; then stop_pid "$pid" slurmd; fi
    if pid="$(live_pid "$ctld_pid" slurmctld)"; then stop_pid "$pid" slurmctld; fi
    if [[ -e $munge_marker ]]; then
        if pid="$(live_pid "$munge_pid" munged)"; then stop_pid "$pid" munged; fi
        rm -f "$munge_marker"
    fi
    rm -f "$ctld_pid" "$slurmd_pid"
}

status() {
    local pid name file
    for name in slurmctld slurmd munged; do
        case $name in
        slurmctld) file=$ctld_pid ;;
        slurmd) file=$slurmd_pid ;;
        munged) file=$munge_pid ;;
        esac
        if pid="$(live_pid "$file" "$name")"; then echo "$name: running ($pid)"; else echo "$name: not running"; fi
    done
    echo "SLURM_CONF=$conf"
    # sinfo with no controller to answer retries for 9-60 s before it fails: ask it only when there is one
    if live_pid "$ctld_pid" slurmctld >/dev/null; then
        sinfo
    else
        echo "no slurmctld: the cluster is down ($0 start)" >&2
        return 1
    fi
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
