#!/usr/bin/env bash
# Start a local SLURM cluster of N nodes (default 2), each node a network namespace of this machine.
#
#   sudo cluster/dev/up.sh [N]        # then: sinfo; srun -N2 hostname; cluster/dev/down.sh
#
# Root namespace = controller host (slurmctld, 10.77.0.1 on bridge fr-br0); node<i> = namespace
# fr-node<i> at 10.77.0.(10+i) with its own hostname, running its own slurmd. Re-runnable: stops
# what a previous run started, clears the controller state and starts again. Installs the Debian
# packages it needs if they are missing (apt-get). State, logs and pid files live under
# $FR_SLURM_STATE (default /var/lib/forge-dev-slurm); the config is written to /etc/slurm/slurm.conf
# (an existing foreign one is saved as slurm.conf.forge-backup and restored by down.sh).
set -euo pipefail

N="${1:-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${FR_SLURM_STATE:-/var/lib/forge-dev-slurm}"
PREFIX="${FR_NET_PREFIX:-10.77.0}"
CONF=/etc/slurm/slurm.conf
WAIT_S="${FR_SLURM_WAIT_S:-60}"
MARK="forge-dev-slurm"

log() { echo "[up.sh] $*"; }
die() { echo "[up.sh] ERROR: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] || die "N must be a positive integer, got '$N'"
T0=$(date +%s)

# 1. Packages (only when missing).
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sinfo >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v ip >/dev/null || need+=(iproute2)
{ command -v nsenter >/dev/null && command -v unshare >/dev/null && command -v runuser >/dev/null; } \
    || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || true
    apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# 2. Stop whatever a previous run left (our daemons, found by pid file, and the namespaces),
#    so the cluster has exactly N nodes afterwards.
"$HERE/down.sh" --keep-munge >/dev/null 2>&1 || true

# 3. Network namespaces and /etc/hosts.
"$HERE/netns.sh" up "$N" >/dev/null

# 4. munge: key if missing, daemon if not running.
mkdir -p "$STATE"/{ctld,spool,run,log}
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --force --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
fi
id munge >/dev/null 2>&1 || die "user 'munge' missing (is the munge package installed?)"
chown munge:munge /etc/munge /etc/munge/munge.key; chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged
    echo yes >"$STATE/run/munged.started"
    for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged did not start (see /var/log/munge/munged.log)"
fi

# 5. slurm.conf: node sizes from what slurmd sees on this machine.
CPUS=$(slurmd -C 2>/dev/null | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1); CPUS=${CPUS:-2}
MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1); MEM=${MEM:-4096}
NODE_MEM=$(( MEM / N )); [ "$NODE_MEM" -gt 8192 ] && NODE_MEM=8192; [ "$NODE_MEM" -lt 256 ] && NODE_MEM=256
NODES=""
for i in $(seq 1 "$N"); do
    NODES+="NodeName=node$i NodeAddr=$PREFIX.$((10 + i)) NodeHostname=node$i CPUs=$CPUS RealMemory=$NODE_MEM State=UNKNOWN"$'\n'
done
NODELIST="node[1-$N]"; [ "$N" = 1 ] && NODELIST=node1
mkdir -p /etc/slurm
if [ -f "$CONF" ] && ! grep -q "$MARK" "$CONF"; then
    log "saving existing $CONF as $CONF.forge-backup"; mv "$CONF" "$CONF.forge-backup"
fi
CTLD_HOST=$(hostname -s)
sed -e "s|@CTLD_HOST@|$CTLD_HOST|" -e "s|@CTLD_ADDR@|$PREFIX.1|" -e "s|@STATE@|$STATE|g" \
    -e "s|@NODELIST@|$NODELIST|" "$HERE/slurm.conf.in" \
  | awk -v nodes="${NODES%$'\n'}" '{ if ($0 == "@NODES@") print nodes; else print }' >"$CONF"
chmod 644 "$CONF"

# 6. Daemons: slurmctld here (-c: start from clean state), one slurmd per namespace node.
rm -rf "$STATE/ctld"/* "$STATE/spool"/*
slurmctld -c || die "slurmctld failed to start (see $STATE/log/slurmctld.log)"
for i in $(seq 1 "$N"); do
    mkdir -p "$STATE/spool/node$i"
    # nsenter (not `ip netns exec`: that remounts /sys and hides cgroup mounts) plus a private
    # UTS namespace so `hostname` inside jobs says node<i>. slurmd daemonizes and keeps both.
    nsenter --net="/var/run/netns/fr-node$i" unshare --uts \
        sh -c "hostname node$i && exec slurmd -N node$i" \
        || die "slurmd node$i failed to start (see $STATE/log/slurmd-node$i.log)"
done

# 7. Wait (bounded) until every node is idle.
log "waiting up to ${WAIT_S}s for $N idle nodes"
deadline=$(( $(date +%s) + WAIT_S ))
while :; do
    idle=$(sinfo -h -N -p dev -t idle -o '%N' 2>/dev/null | sort -u | grep -c . || true)
    [ "$idle" -ge "$N" ] && break
    if [ "$(date +%s)" -ge "$deadline" ]; then
        sinfo -N -l || true
        tail -n 20 "$STATE/log/slurmctld.log" >&2 || true
        die "only $idle of $N nodes idle after ${WAIT_S}s (logs in $STATE/log)"
    fi
    sleep 1
done

log "cluster up in $(( $(date +%s) - T0 ))s: controller $CTLD_HOST ($PREFIX.1), partition dev"
sinfo -N -o '%N %T %c %m %P' | sed 's/^/    /'
for i in $(seq 1 "$N"); do echo "    node$i = $PREFIX.$((10 + i)) (netns fr-node$i)"; done
log "config $CONF, state and logs $STATE; stop with $HERE/down.sh"
