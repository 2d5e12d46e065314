#!/usr/bin/env bash
# Stop the local SLURM cluster started by up.sh; idempotent (safe when nothing is running).
#
#   sudo cluster/dev/down.sh
#
# Cancels all jobs, stops the slurmd/slurmctld daemons up.sh started (found by their pid files
# under $FR_SLURM_STATE), stops munged if up.sh started it, removes the namespaces, the bridge and
# the /etc/hosts entries (netns.sh down) and removes the generated /etc/slurm/slurm.conf (restoring
# a saved foreign one). --keep-net / --keep-munge are used by up.sh when it restarts.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${FR_SLURM_STATE:-/var/lib/forge-dev-slurm}"
CONF=/etc/slurm/slurm.conf
KEEP_NET=0; KEEP_MUNGE=0
for a in "$@"; do
    case "$a" in --keep-net) KEEP_NET=1 ;; --keep-munge) KEEP_MUNGE=1 ;;
        *) echo "usage: $0 [--keep-net] [--keep-munge]" >&2; exit 2 ;; esac
done
[ "$(id -u)" = 0 ] || { echo "[down.sh] must run as root" >&2; exit 1; }

# stop_pidfile FILE NAME: TERM the process in FILE if its command is NAME, KILL after 10 s.
stop_pidfile() {
    local f="$1" name="$2" pid st
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null || true)
    if [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$name" ]; then
        kill "$pid" 2>/dev/null || true
        # Done when gone or a zombie (daemons are reparented to pid 1, which may reap late).
        for _ in $(seq 1 100); do
            st=$(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null || true)
            [ -z "$st" ] || [ "$st" = Z ] && break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

# 1. Jobs (only if our controller answers).
if [ -f "$STATE/run/slurmctld.pid" ] && command -v scancel >/dev/null; then
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    [ -n "$jobs" ] && timeout 10 scancel $jobs 2>/dev/null && sleep 1
fi

# 2. Daemons.
for f in "$STATE"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done
stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
if [ "$KEEP_MUNGE" = 0 ] && [ -f "$STATE/run/munged.started" ]; then
    stop_pidfile /run/munge/munged.pid munged
    rm -f "$STATE/run/munged.started"
fi

# 3. Network namespaces (kills anything left inside them, e.g. job steps) and the config.
if [ "$KEEP_NET" = 0 ]; then
    "$HERE/netns.sh" down >/dev/null
    if [ -f "$CONF" ] && grep -q forge-dev-slurm "$CONF"; then
        rm -f "$CONF"
        [ -f "$CONF.forge-backup" ] && mv "$CONF.forge-backup" "$CONF"
    fi
fi
echo "[down.sh] stopped (state and logs kept in $STATE)"
exit 0
