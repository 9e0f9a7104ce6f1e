package k8s

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// --- the network's own CPU: the chain's processes and the agent ---

// The machine's CPU in a burst (cpuacct_test.go) is every program's, and
// other runs on this machine (other clusters' plugins and agents) share
// the names. The network's own CPU is counted from this cluster's
// processes only: each plugin exec of a burst's sandboxes (the process
// events name them, with their parent: containerd for the chain's
// plugins, bridge for host-local, portmap for iptables), all the tasks
// that exited with that name and parent (a Go plugin's threads have its
// parent too), and n1's agent (the kvipam-agent process in n1's network
// namespace). containerd's loopback, which it runs beside the chain for
// every network, is not the chain's and is left out.

// chainKeys are the taskstats keys of the ADD execs of the sandboxes ids
// (each plugin, and what it ran in turn), loopback's left out.
func chainKeys(w *procWatch, ids map[string]bool) map[taskKey]bool {
	keys := map[taskKey]bool{}
	if w == nil {
		return keys
	}
	for _, es := range w.execsOf("ADD", ids) {
		for _, e := range es {
			if e.comm != "" && e.comm != "loopback" {
				keys[taskKey{comm: e.comm, ppid: e.ppid}] = true
			}
		}
	}
	return keys
}

// netCPU is a network's own CPU in its bursts, by program (the agent as
// kvipam-agent), summed over the bursts.
type netCPU struct {
	bursts int
	byProg map[string]time.Duration
}

// add counts one burst: the chain's exited tasks (by keys) and the
// agent's own time (pid, 0 when there is none) between snapshots a and b.
func (n *netCPU) add(a, b cpuSnapshot, keys map[taskKey]bool, agent int) {
	n.bursts++
	if n.byProg == nil {
		n.byProg = map[string]time.Duration{}
	}
	for k := range keys {
		if d := b.exits[k].cpu - a.exits[k].cpu; d > 0 {
			n.byProg[k.comm] += d
		}
	}
	if p, ok := b.procs[agent]; ok && agent != 0 {
		was := a.procs[agent]
		if was.start != p.start {
			was = procCPU{}
		}
		n.byProg[p.comm] += p.self - was.self
	}
}

// perPod is the network's own CPU per pod in bursts of n, in ms (the mean
// over the bursts), and by program.
func (n *netCPU) perPod(pods int) (float64, map[string]float64) {
	by := map[string]float64{}
	if n.bursts == 0 || pods == 0 {
		return 0, by
	}
	var sum float64
	for p, d := range n.byProg {
		by[p] = ms(d) / float64(n.bursts*pods)
		sum += by[p]
	}
	return sum, by
}

// describe lists by the programs, most first, in ms a pod.
func describeProgs(by map[string]float64) string {
	var parts []string
	for _, p := range mostFirst(by) {
		parts = append(parts, fmt.Sprintf("%s %.2f", p, by[p]))
	}
	return strings.Join(parts, ", ")
}

// agentPID is the kvipam-agent process in node's network namespace (the
// agent runs with the host's network, the node's), 0 when there is none.
func (c *kcluster) agentPID(node string) int {
	n := c.node(node)
	if n == nil || n.holder == nil || n.holder.Process == nil {
		return 0
	}
	want, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", n.holder.Process.Pid))
	if err != nil {
		return 0
	}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		comm, err := os.ReadFile(d + "/comm")
		if err != nil || string(bytes.TrimSpace(comm)) != "kvipam-agent" {
			continue
		}
		if ns, err := os.Readlink(d + "/ns/net"); err == nil && ns == want {
			pid, _ := strconv.Atoi(filepath.Base(d))
			return pid
		}
	}
	return 0
}

// rssMB is a process's resident set in MB (VmRSS), 0 when unknown.
func rssMB(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// loadAvg is the machine's 1-minute load average.
func loadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

// sortedProgs is by's names in order.
func sortedProgs(by map[string]float64) []string { return slices.Sorted(maps.Keys(by)) }
