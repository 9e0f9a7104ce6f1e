package e2e

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// BenchmarkHostPortAdd is what a pod's host ports cost its ADD and DEL:
// kvipam on the bpf datapath with no mapping (the base), with two
// mappings (TCP and UDP) served by the datapath, and with the same two
// served by a chained portmap (kvipam does not declare portMappings, and
// portmap's iptables program the node's nat table). One node, the three
// configurations interleaved in rounds, one pod at a time. It reports the
// ADD's wall time (p50) and the CPU a pod costs, ADD and DEL together:
// every plugin process and its children (portmap's iptables), and the
// agent.
//
//	go test -run '^$' -bench HostPortAdd -benchtime 100x ./e2e/
func BenchmarkHostPortAdd(b *testing.B) {
	requireBPF(b)
	n := newNode(b, "hpb")
	n.startAgent(agentOpts{pools: []string{"default=10.1.0.0/16,fd10::/112"}, datapath: "bpf"})
	quiet := `,"logLevel":"off"`
	configs := []struct {
		name  string
		list  *libcni.NetworkConfigList
		ports bool
	}{
		{"none", n.kvipamList("kv", "1.0.0", quiet), false},
		{"bpf", n.kvipamList("kv", "1.0.0", quiet+`,"capabilities":{"portMappings":true}`), true},
		{"portmap", n.kvipamList("kv", "1.0.0", quiet, `{"type":"portmap","capabilities":{"portMappings":true}}`), true},
	}
	agentPid := n.agent.Process.Pid
	port := 20000
	type sample struct {
		add     time.Duration
		cpu     time.Duration // plugins' and agent's, ADD and DEL
		samples int
	}
	res := map[string]*sample{}
	adds := map[string][]time.Duration{}
	one := func(name string, l *libcni.NetworkConfigList, ports bool, tag string) {
		nsn, release, err := nstest.NewEphemeralNS()
		require.NoError(b, err)
		defer release()
		p := podIn(tag, nsn)
		if ports {
			port++
			p.rt.CapabilityArgs = map[string]any{"portMappings": []map[string]any{
				mapping("tcp", port, 80, ""), mapping("udp", port, 81, ""),
			}}
		}
		cpu0, agent0 := childrenCPU(b), processCPU(b, agentPid)
		start := time.Now()
		require.NoError(b, n.do(func() error {
			_, err := n.cni.AddNetworkList(context.Background(), l, p.rt)
			return err
		}), "%s ADD", name)
		add := time.Since(start)
		require.NoError(b, n.do(func() error { return n.cni.DelNetworkList(context.Background(), l, p.rt) }), "%s DEL", name)
		cpu := childrenCPU(b) - cpu0 + processCPU(b, agentPid) - agent0
		s := res[name]
		if s == nil {
			s = &sample{}
			res[name] = s
		}
		s.cpu += cpu
		s.samples++
		adds[name] = append(adds[name], add)
	}
	for _, c := range configs {
		one(c.name, c.list, c.ports, c.name+"-warm")
	}
	clear(res)
	clear(adds)
	b.ResetTimer()
	const rounds = 5
	for r := range rounds {
		for _, c := range configs {
			for i := range max(b.N/rounds, 1) {
				one(c.name, c.list, c.ports, fmt.Sprintf("%s-%d-%d", c.name, r, i))
			}
		}
	}
	b.StopTimer()
	awaitReaped(b, n)
	for _, c := range configs {
		s := res[c.name]
		b.ReportMetric(ms(pct(adds[c.name], 50)), c.name+"-add-p50-ms")
		b.ReportMetric(ms(s.cpu)/float64(s.samples), c.name+"-cpu-ms/pod")
	}
	per := func(name string) float64 { return ms(res[name].cpu) / float64(res[name].samples) }
	b.ReportMetric(per("bpf")-per("none"), "bpf-mapping-cpu-ms/pod")
	b.ReportMetric(per("portmap")-per("none"), "portmap-mapping-cpu-ms/pod")
	b.ReportMetric(ms(pct(adds["bpf"], 50))-ms(pct(adds["none"], 50)), "bpf-mapping-add-p50-ms")
	b.ReportMetric(ms(pct(adds["portmap"], 50))-ms(pct(adds["none"], 50)), "portmap-mapping-add-p50-ms")
}

// childrenCPU is the user and system CPU of this process's waited-for
// children and their own waited-for children: the plugins libcni ran.
func childrenCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processCPU is pid's user and system CPU so far (/proc/PID/stat, in
// clock ticks).
func processCPU(b *testing.B, pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(b, err)
	s := string(raw)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	// utime and stime are fields 14 and 15 of stat; fields[0] is field 3.
	ut, err := strconv.ParseInt(fields[11], 10, 64)
	require.NoError(b, err)
	st, err := strconv.ParseInt(fields[12], 10, 64)
	require.NoError(b, err)
	const ticks = 100 // USER_HZ
	return time.Duration(ut+st) * time.Second / ticks
}
