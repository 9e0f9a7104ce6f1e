package k8s

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestNetCPUCountsOnlyTheChain: a burst's network CPU is the exited tasks
// of the chain's keys (the plugin under this containerd, what it ran
// under the plugin) and the agent's own time; another cluster's plugin of
// the same name (another parent) and loopback are not counted, and an
// agent restarted meanwhile counts whole.
func TestNetCPUCountsOnlyTheChain(t *testing.T) {
	w := &procWatch{}
	w.done = []cniExec{
		{plugin: "kvipam", comm: "kvipam", ppid: 100, pid: 200, command: "ADD", container: "s1"},
		{plugin: "portmap", comm: "portmap", ppid: 100, pid: 201, command: "ADD", container: "s1"},
		{plugin: "xtables-nft-multi", comm: "iptables", ppid: 201, pid: 202, command: "ADD", container: "s1"},
		{plugin: "loopback", comm: "loopback", ppid: 100, pid: 203, command: "ADD", container: "s1"},
		{plugin: "kvipam", comm: "kvipam", ppid: 900, pid: 901, command: "ADD", container: "other"},
	}
	keys := chainKeys(w, map[string]bool{"s1": true})
	require.Equal(t, map[taskKey]bool{{"kvipam", 100}: true, {"portmap", 100}: true, {"iptables", 201}: true}, keys)

	ms := time.Millisecond
	a := cpuSnapshot{
		procs: map[int]procCPU{7: {comm: "kvipam-agent", start: 1, self: 50 * ms}},
		exits: map[taskKey]exitCPU{{"kvipam", 100}: {tasks: 1, cpu: 5 * ms}},
	}
	b := cpuSnapshot{
		procs: map[int]procCPU{7: {comm: "kvipam-agent", start: 1, self: 80 * ms}},
		exits: map[taskKey]exitCPU{
			{"kvipam", 100}: {tasks: 3, cpu: 25 * ms}, {"portmap", 100}: {tasks: 1, cpu: 4 * ms},
			{"iptables", 201}: {tasks: 1, cpu: 6 * ms}, {"loopback", 100}: {tasks: 1, cpu: 9 * ms},
			{"kvipam", 900}: {tasks: 1, cpu: 99 * ms},
		},
	}
	var n netCPU
	n.add(a, b, keys, 7)
	sum, by := n.perPod(2)
	require.Equal(t, map[string]float64{"kvipam": 10, "portmap": 2, "iptables": 3, "kvipam-agent": 15}, by)
	require.Equal(t, 30.0, sum)

	// The agent restarted between the snapshots: its whole time counts.
	b.procs[7] = procCPU{comm: "kvipam-agent", start: 2, self: 8 * ms}
	var r netCPU
	r.add(a, b, nil, 7)
	_, by = r.perPod(1)
	require.Equal(t, map[string]float64{"kvipam-agent": 8}, by)
}
