#!/usr/bin/env bash
# Fake "hosts" on one machine: N network namespaces on a private bridge.
#
#   netns.sh up N     create fr-node1..fr-nodeN (idempotent; extra old nodes are kept)
#   netns.sh down     remove every fr-node* namespace, the bridge and the /etc/hosts entries
#   netns.sh status   list namespaces and their addresses
#
# Layout (10.77.0.0/24, never routed anywhere else):
#   root namespace  : bridge fr-br0 = 10.77.0.1   (the controller host, slurmctld)
#   fr-node<i>      : eth0 = 10.77.0.(10+i)       (veth peer fr-veth<i> on fr-br0), lo up
#   /etc/hosts      : "10.77.0.(10+i) node<i>" lines tagged "# forge-dev"
#
# A process joins node i with:  nsenter --net=/var/run/netns/fr-node<i> CMD
# (prefer nsenter over `ip netns exec`, which remounts /sys and hides cgroup mounts).
# Override the subnet prefix with FR_NET_PREFIX (default 10.77.0). Needs root and iproute2.
set -euo pipefail

PREFIX="${FR_NET_PREFIX:-10.77.0}"
BR=fr-br0
TAG="# forge-dev"

die() { echo "netns.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"
command -v ip >/dev/null || die "iproute2 (ip) is missing: apt-get install -y iproute2"

hosts_remove() {
    # Rewrite in place (not mv): /etc/hosts is often a bind mount in containers.
    if grep -q "$TAG" /etc/hosts 2>/dev/null; then
        local tmp; tmp=$(mktemp)
        grep -v "$TAG" /etc/hosts >"$tmp" || true
        cat "$tmp" >/etc/hosts; rm -f "$tmp"
    fi
}

up() {
    local n="${1:-2}"
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "N must be 1..200, got '$n'"
    if ! ip link show "$BR" >/dev/null 2>&1; then
        ip link add "$BR" type bridge
    fi
    ip addr replace "$PREFIX.1/24" dev "$BR"
    ip link set "$BR" up
    for i in $(seq 1 "$n"); do
        local ns="fr-node$i" veth="fr-veth$i" addr="$PREFIX.$((10 + i))"
        [ -e "/var/run/netns/$ns" ] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            # Peer may survive inside the namespace from a half-finished run: drop it first.
            ip -n "$ns" link del eth0 2>/dev/null || true
            ip link add "$veth" type veth peer name eth0 netns "$ns"
        fi
        ip link set "$veth" master "$BR"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr replace "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    # /etc/hosts: node names -> namespace addresses (idempotent: rewrite our lines).
    hosts_remove
    # One line per existing fr-node<i> (a larger earlier "up" keeps its names).
    local ns i
    for ns in $(ip netns list | awk '{print $1}' | grep '^fr-node[0-9]*$' | sort -V); do
        i=${ns#fr-node}
        echo "$PREFIX.$((10 + i)) node$i $TAG" >>/etc/hosts
    done
    # STP is off on a new bridge, so ports forward at once: no settle wait needed.
    status
}

down() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^fr-node' || true); do
        # Kill whatever still lives in the namespace (only processes inside it).
        local pids; pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill $pids 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    local l
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep '^fr-veth' || true); do
        ip link del "$l" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
    hosts_remove
    echo "netns.sh: down"
}

status() {
    echo "bridge $BR: $(ip -br -4 addr show "$BR" 2>/dev/null | awk '{print $3}')"
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^fr-node' | sort -V || true); do
        echo "$ns: $(ip -n "$ns" -br -4 addr show eth0 2>/dev/null | awk '{print $3}')"
    done
}

case "${1:-}" in
    up) up "${2:-2}" ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up [N] | down | status" >&2; exit 2 ;;
esac
