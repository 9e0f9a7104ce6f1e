#!/usr/bin/env bash
# The kvipam flow with cnitool, as a person would run it by hand: an agent
# in a node namespace, two pods, ping, CHECK, DEL, a second DEL, and the
# node's veths, routes and allocations gone.
#
# Usage: BIN=<dir with kvipam, kvipam-agent, cnitool, loopback> WORK=<empty dir> cnitool.sh
# Needs root, iproute2, util-linux (unshare) and ping. Everything happens in
# namespaces this script makes: a private mount namespace (so cnitool's
# cache in /var/lib/cni and the named netns mounts never reach the real
# host), and a node and two pod network namespaces.
set -euo pipefail
: "${BIN:?set BIN}" "${WORK:?set WORK}"

if [ -z "${KVIPAM_CNITOOL_PRIVATE:-}" ]; then
	exec unshare --mount --propagation private env KVIPAM_CNITOOL_PRIVATE=1 "$0" "$@"
fi
mount -t tmpfs tmpfs /var/lib # cnitool's cache goes to /var/lib/cni
mkdir -p /var/lib/cni /run/netns
mount -t tmpfs tmpfs /run/netns

suffix=$$
node=kvnode$suffix pod_a=kvpoda$suffix pod_b=kvpodb$suffix
agent_pid=
cleanup() {
	[ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null || true
	for n in "$pod_a" "$pod_b" "$node"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; [ -f "$WORK/agent.log" ] && tail -20 "$WORK/agent.log" >&2; exit 1; }
step() { echo "--- $*"; }
# gone CMD...: awaits CMD failing (the thing it looks for gone). The agent
# answers DEL once the veth is retired (routes gone) and deletes the veth
# in the background, so its removal is an event to wait for; the bound
# only stops a script whose veth never goes.
gone() { for _ in $(seq 1 1200); do "$@" || return 0; sleep 0.1; done; return 1; }
has_eth0() { ip -n "$1" link show eth0 >/dev/null 2>&1; }
host_veths() { ip -n "$node" -o link show | grep -q ': kv'; }

for n in "$node" "$pod_a" "$pod_b"; do
	ip netns add "$n"
	ip -n "$n" link set lo up
done
# The node: an uplink as a node has a NIC, an address for the pods to
# reach, and forwarding on.
ip -n "$node" link add uplink0 type veth peer name uplink1
ip -n "$node" addr add 192.0.2.1/32 dev lo
ip netns exec "$node" sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1

step "start kvipam-agent in $node"
sock=$WORK/agent.sock
ip netns exec "$node" "$BIN/kvipam-agent" --node "$node" --etcd-embedded --state-dir "$WORK/state" --socket "$sock" \
	--pool default=10.4.0.0/16,fd00:4::/64 --datapath routes --metrics-addr '' \
	--del-queue-dir "$WORK/del-queue" >"$WORK/agent.log" 2>&1 &
agent_pid=$!
for _ in $(seq 1 600); do [ -S "$sock" ] && break; kill -0 "$agent_pid" 2>/dev/null || fail "agent exited"; sleep 0.1; done
[ -S "$sock" ] || fail "agent socket $sock did not appear"

mkdir -p "$WORK/net.d"
cat >"$WORK/net.d/10-kvipam.conflist" <<EOF
{"cniVersion": "1.1.0", "name": "kvipam", "plugins": [
  {"type": "kvipam", "agentSocket": "$sock", "delQueueDir": "$WORK/del-queue"}]}
EOF
cnitool() { ip netns exec "$node" env CNI_PATH="$BIN" NETCONFPATH="$WORK/net.d" "$BIN/cnitool" "$@"; }
addr_of() { sed -n 's/.*"address": "\([0-9.]*\)\/32".*/\1/p' <<<"$1" | head -1; }

step "ADD two pods"
res_a=$(cnitool add kvipam "/run/netns/$pod_a") || fail "add a"
res_b=$(cnitool add kvipam "/run/netns/$pod_b") || fail "add b"
ip_a=$(addr_of "$res_a") ip_b=$(addr_of "$res_b")
[ -n "$ip_a" ] && [ -n "$ip_b" ] || fail "no IPv4 address in the results: $res_a $res_b"
echo "pod a: $ip_a, pod b: $ip_b"

step "ping between the pods and to the node"
ip netns exec "$pod_a" ping -c1 -W2 "$ip_b" >/dev/null || fail "ping a -> b"
ip netns exec "$pod_b" ping -c1 -W2 "$ip_a" >/dev/null || fail "ping b -> a"
ip netns exec "$pod_a" ping -c1 -W2 192.0.2.1 >/dev/null || fail "ping a -> node"
ip netns exec "$node" ping -c1 -W2 "$ip_a" >/dev/null || fail "ping node -> a"

step "CHECK"
cnitool check kvipam "/run/netns/$pod_a" || fail "check a"
cnitool check kvipam "/run/netns/$pod_b" || fail "check b"

step "DEL, then DEL again"
cnitool del kvipam "/run/netns/$pod_a" || fail "del a"
cnitool del kvipam "/run/netns/$pod_a" || fail "second del a"
gone has_eth0 "$pod_a" || fail "pod a still has eth0"
ip -n "$node" route show "$ip_a/32" | grep -q . && fail "node still routes $ip_a"
cnitool del kvipam "/run/netns/$pod_b" || fail "del b"
gone host_veths || fail "host veths left: $(ip -n "$node" -o link show | grep ': kv')"

step "STATUS"
cnitool status kvipam "/run/netns/$pod_b" || fail "status"

echo "PASS"
