package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/e2e/chaos"
)

// TestBGPWithdrawsWhenLeaseLost: node f3 is cut off from etcd (every
// packet to and from etcd's port dropped in its namespace; its BGP
// session to the router stays up) for longer than its lease (15 s). It
// withdraws every prefix it announced before etcd can expire its lease:
// FRR drops them, over the live session, within the lease TTL of the
// cut's start (the time is logged). Once etcd has expired the lease, node
// f1 claims f3's empty IPv4 block (a pod asking for an address in it) and
// announces it. The router's kernel deleted its route to the block (FRR
// had no path left) before it added f1's, and a poll of FRR's tables
// every 100 ms through all of it never saw two announcers of a prefix.
// Healed, f3 takes a new lease and announces exactly what it holds again:
// not the block f1 took.
func TestBGPWithdrawsWhenLeaseLost(t *testing.T) {
	f := newBGPFabric(t, []bgpNodeSpec{{name: "f1", rack: "A", host: 11}, {name: "f3", rack: "B", host: 13}})
	b, a := f.nodes[0], f.nodes[1] // f1 runs the embedded etcd; f3 is cut off from it
	a.addPod(t, "f3-p0")
	b.addPod(t, "f1-p0")
	f.waitTables(t)

	// f3's pod goes: its blocks stay claimed, empty, and announced.
	require.NoError(t, a.n.del(a.l, a.pods[0]))
	a.pods, a.ips = nil, nil
	var aPrefixes []netip.Prefix
	for _, fam := range []string{"ipv4", "ipv6"} {
		blocks := a.n.poolStatus("default", fam).Blocks
		require.Len(t, blocks, 1, "f3 keeps its empty %s block", fam)
		aPrefixes = append(aPrefixes, blocks[0])
	}
	aBlock := aPrefixes[0]
	f.waitTables(t)

	names := map[netip.Addr]string{}
	for _, n := range f.nodes {
		names[n.v4], names[n.v6] = n.n.name, n.n.name
	}
	poll := pollFRR(t, f.frr, names, []string{"ipv4", "ipv6"}, 100*time.Millisecond)
	w := watchNetlink(t, f.r.ns)
	before := f.frr.neighbor(a.v4)
	cut := time.Now()
	cutFromEtcd(t, a.n, 2379)
	waitFor(t, 40*time.Second, "FRR to withdraw every prefix of the node cut off from etcd", func() bool {
		return !slices.ContainsFunc(aPrefixes, func(p netip.Prefix) bool { return f.frr.announcedBy(p, a.v4) })
	})
	withdrawn := time.Since(cut)
	deleted, ok := w.first(cut, "route delete "+aBlock.String()+" ")
	require.True(t, ok, "the router's kernel deleted its route to %s", aBlock)
	const ttl = 15 * time.Second // the e2e agents' --lease-ttl
	t.Logf("f3 cut off from etcd: FRR withdrew its prefixes within %s, the router's kernel deleted its route to %s %s after the cut (lease TTL %s)",
		withdrawn.Round(time.Millisecond), aBlock, deleted.Sub(cut).Round(time.Millisecond), ttl)
	require.Less(t, deleted.Sub(cut), ttl, "withdrawn within the lease TTL of the cut's start, before etcd can expire the lease")
	after := f.frr.neighbor(a.v4)
	require.Equal(t, before.Dropped, after.Dropped, "withdrawn over the live session, which never dropped")

	// etcd expires f3's lease; f1 then claims f3's empty IPv4 block.
	waitFor(t, 40*time.Second, "etcd to expire f3's claim on "+aBlock.String(), func() bool {
		row, ok := blockRow(t, b, aBlock)
		return !ok || row.State != inspect.BlockClaimed
	})
	expired := time.Since(cut)
	in := aBlock.Addr().Next().Next()
	l := b.n.kvipamList("kv-static", "1.0.0", `,"capabilities":{"ips":true}`)
	p := newPod(t, "f1-static")
	p.rt.CapabilityArgs = map[string]any{"ips": []string{in.String()}}
	res := b.n.mustAdd(l, p)
	v4, _ := podAddrs(t, res)
	require.Equal(t, in, v4)
	row, _ := blockRow(t, b, aBlock)
	require.Equal(t, inspect.BlockClaimed, row.State)
	require.Equal(t, "f1", row.Node, "f1 claimed the block f3 lost")
	waitFor(t, 30*time.Second, "FRR to route "+aBlock.String()+" via f1", func() bool { return f.frr.announcedBy(aBlock, b.v4) })
	announced := time.Now()
	t.Logf("etcd expired f3's claims %s after the cut; f1 claimed and announced %s", expired.Round(time.Millisecond), aBlock)

	// Healed: f3 takes a new lease and announces what it holds then.
	healEtcd(t, a.n, 2379)
	waitFor(t, 60*time.Second, "f3 ready again on a new lease", func() bool { return a.n.status().Ready })
	f.waitTables(t)
	require.True(t, f.frr.announcedBy(aBlock, b.v4))
	require.False(t, f.frr.announcedBy(aBlock, a.v4), "f3 does not announce the block f1 took")

	// The router's kernel, watched through netlink: after the cut its
	// route to the block was deleted (FRR had no path left to it) before
	// it was added again (f1's): never both.
	var seq []string
	for _, e := range w.between(cut, time.Now()) {
		if strings.Contains(e, " route ") && strings.Contains(e, " "+aBlock.String()+" ") {
			seq = append(seq, e)
		}
	}
	t.Logf("the router's kernel routes to %s after the cut:\n%s", aBlock, strings.Join(seq, "\n"))
	require.True(t, len(seq) >= 2 && strings.Contains(seq[0], "route delete "+aBlock.String()+" via "+a.v4.String()+" ") &&
		strings.Contains(seq[1], "route add "+aBlock.String()+" via "+b.v4.String()+" "), "f3's route deleted (no path left) before f1's was added")
	for _, e := range seq[1:] {
		require.NotContains(t, e, "via "+a.v4.String()+" ", "never via f3 again")
	}

	polls := poll.stop()
	require.True(t, len(polls) > 1 && polls[0].At.Before(cut) && polls[len(polls)-1].At.After(announced), "FRR polled from before the cut to after f1 announced")
	var gap time.Duration
	for i := 1; i < len(polls); i++ {
		gap = max(gap, polls[i].At.Sub(polls[i-1].At))
	}
	for _, fd := range chaos.DoubleAnnounced(polls, 0) {
		t.Errorf("%s", fd)
	}
	t.Logf("%d polls of FRR's tables over %s (at most %s apart): no prefix had two announcers", len(polls),
		polls[len(polls)-1].At.Sub(polls[0].At).Round(time.Second), gap.Round(time.Millisecond))
}

// cutFromEtcd drops every packet to and from etcd's port in n's
// namespace: a partition between the node and etcd alone.
func cutFromEtcd(t *testing.T, n *node, port int) {
	t.Helper()
	for _, r := range etcdRules(port) {
		out, err := exec.Command("nsenter", append([]string{"--net=" + n.host.Path(), "iptables", "-I"}, r...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
}

// healEtcd removes cutFromEtcd's rules.
func healEtcd(t *testing.T, n *node, port int) {
	t.Helper()
	for _, r := range etcdRules(port) {
		out, err := exec.Command("nsenter", append([]string{"--net=" + n.host.Path(), "iptables", "-D"}, r...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
}

func etcdRules(port int) [][]string {
	p := fmt.Sprint(port)
	return [][]string{{"OUTPUT", "-p", "tcp", "--dport", p, "-j", "DROP"}, {"INPUT", "-p", "tcp", "--sport", p, "-j", "DROP"}}
}

// blockRow is block's row of kvipamctl block list, run in node n's
// namespace against the fabric's etcd.
func blockRow(t *testing.T, n *bgpNode, block netip.Prefix) (inspect.BlockRow, bool) {
	t.Helper()
	var out []byte
	require.NoError(t, n.n.do(func() (err error) {
		out, err = exec.Command(n.n.bin+"/kvipamctl", "block", "list", "--pool", "default", "-o", "json", "--endpoints", "http://"+n.v4.String()+":2379").CombinedOutput()
		return err
	}), "%s", out)
	var rows []inspect.BlockRow
	require.NoError(t, json.Unmarshal(out, &rows), "%s", out)
	for _, r := range rows {
		if r.Block == block {
			return r, true
		}
	}
	return inspect.BlockRow{}, false
}

// announcedBy reports whether FRR's table holds a path to p from the
// peer whose next hop is nh (of p's family).
func (f *frr) announcedBy(p netip.Prefix, nh netip.Addr) bool {
	f.t.Helper()
	tbl, err := f.paths(familyOf(p))
	require.NoError(f.t, err)
	return slices.Contains(tbl[p], nh)
}

func familyOf(p netip.Prefix) string {
	if p.Addr().Is4() {
		return "ipv4"
	}
	return "ipv6"
}

// paths are FRR's BGP table of family: each prefix with the next hop of
// every path it has (a stale one too: the router still forwards by it).
func (f *frr) paths(family string) (map[netip.Prefix][]netip.Addr, error) {
	out, err := f.vtysh("show bgp " + family + " unicast json")
	if err != nil {
		return nil, fmt.Errorf("vtysh: %w: %s", err, out)
	}
	var tbl struct {
		Routes map[string][]frrPath `json:"routes"`
	}
	if err := json.Unmarshal(out, &tbl); err != nil {
		return nil, fmt.Errorf("show bgp %s unicast json: %w", family, err)
	}
	res := map[netip.Prefix][]netip.Addr{}
	for s, ps := range tbl.Routes {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, err
		}
		for _, path := range ps {
			for _, nh := range path.Nexthops {
				if a, err := netip.ParseAddr(nh.IP); err == nil && a.Is4() == p.Addr().Is4() {
					res[p] = append(res[p], a)
					break
				}
			}
		}
	}
	return res, nil
}

// frrPoller reads FRR's tables of both families every interval, each
// read stamped with when it began, until stopped.
type frrPoller struct {
	stopc chan struct{}
	done  chan struct{}
	mu    sync.Mutex
	polls []chaos.RouterPoll
}

// pollFRR polls f's tables of families, naming each next hop by its
// node (names).
func pollFRR(t *testing.T, f *frr, names map[netip.Addr]string, families []string, every time.Duration) *frrPoller {
	pl := &frrPoller{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(pl.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			at := time.Now()
			poll := chaos.RouterPoll{At: at, Announcers: map[netip.Prefix][]string{}}
			ok := true
			for _, fam := range families {
				tbl, err := f.paths(fam)
				if err != nil {
					ok = false // FRR busy: this poll says nothing
					break
				}
				for p, nhs := range tbl {
					for _, nh := range nhs {
						name := names[nh]
						if name == "" {
							name = nh.String()
						}
						poll.Announcers[p] = append(poll.Announcers[p], name)
					}
				}
			}
			if ok {
				pl.mu.Lock()
				pl.polls = append(pl.polls, poll)
				pl.mu.Unlock()
			}
			select {
			case <-pl.stopc:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { pl.stop() })
	return pl
}

// stop ends the polling (idempotent) and returns every poll.
func (pl *frrPoller) stop() []chaos.RouterPoll {
	select {
	case <-pl.stopc:
	default:
		close(pl.stopc)
	}
	<-pl.done
	pl.mu.Lock()
	defer pl.mu.Unlock()
	return slices.Clone(pl.polls)
}
