package e2e

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
)

// migrationBound is the convergence bound: routes moved on every
// node, and never two next hops for the VM's address, within 250 ms.
const migrationBound = 250 * time.Millisecond

// TestMigrationBGPMovesSlash32: agents in routing bgp peer with FRR, the
// router every node reaches other nodes' pods through; a client behind
// it (the router's namespace) pings the VM's IPv4 and IPv6 addresses
// every 10 ms. The VM's addresses are in node 1's block, announced as
// the block. Its migration to node 2 (the target admitted there, the
// source's interface down as the guest leaves it, the guest's
// announcement from the target: a gratuitous ARP and an unsolicited
// neighbour advertisement, on which the target's agent cuts over)
// makes a /32 and a /128 appear in FRR's table with node 2 as
// their only next hop, and the router's kernel route them there; the
// pings resume, answered by the target. The source pod's DEL afterwards
// changes nothing the client sees: no route, no path, no lost ping. A
// second migration, node 2 to node 3, moves the /32 and /128 from node
// 2's next hop to node 3's. FRR is polled all along: the two nodes never
// both announce the address for longer than the convergence bound (the
// longest overlap is logged), and never after the move has settled.
func TestMigrationBGPMovesSlash32(t *testing.T) {
	m := startMoveRig(t, "bgp")
	mv1, mv2, mv3 := m.nodes[0], m.nodes[1], m.nodes[2]
	x4, x6 := m.x[0], m.x[1]
	host4, host6 := netip.PrefixFrom(x4, 32), netip.PrefixFrom(x6, 128)
	var block netip.Prefix
	waitFor(t, 30*time.Second, "FRR to hold node 1's block, the VM's addresses in it, and no host route", func() bool {
		for p, nh := range m.frr.nextHops("ipv4") {
			if p.Contains(x4) && p.Bits() < 32 && nh == mv1.v4 {
				block = p
			}
		}
		_, has4 := m.frr.nextHops("ipv4")[host4]
		_, has6 := m.frr.nextHops("ipv6")[host6]
		return block.IsValid() && !has4 && !has6
	})

	router := m.r.ns
	w := watchRoutes(t, []ns.NetNS{router}, x4, x6)
	poll := pollFRRPaths(t, m.frr, host4, host6)
	p4 := startPinger(t, router, x4, 10*time.Millisecond)
	p6 := startPinger(t, router, x6, 10*time.Millisecond)
	p4.awaitAnswers(t, 20*time.Second, time.Time{}, 10)
	p6.awaitAnswers(t, 20*time.Second, time.Time{}, 10)

	// move migrates the VM from its pod to a target admitted on to, and
	// checks what FRR and the router's kernel hold, and the pings.
	move := func(to *moveNode) {
		t.Helper()
		source := m.vm
		target := m.admit(to)
		moves := m.guestMoves(target)
		began := time.Now()
		moves()
		for _, x := range m.x {
			nh := to.v4
			if x.Is6() {
				nh = to.v6
			}
			w.await(t, 30*time.Second, x, []func(hop) bool{func(h hop) bool { return h.gw == nh }})
			waitFor(t, 30*time.Second, "FRR's only path to "+x.String()+" via "+to.n.name, func() bool {
				hops, err := m.frr.frrPaths(netip.PrefixFrom(x, x.BitLen()))
				return err == nil && len(hops) == 1 && hops[0] == nh
			})
		}
		settled := time.Now()
		p4.awaitAnswers(t, 20*time.Second, settled, 10)
		p6.awaitAnswers(t, 20*time.Second, settled, 10)
		require.Greater(t, inEchos(t, target), 0, "the target answers")
		for _, x := range m.x {
			rib, fib := poll.longestOverlap(began, x), w.longestOverlap(began, 0, x)
			t.Logf("%s to %s: the router and FRR settled on it (as polled) %s after the announcement; two next hops at once in FRR's table for at most %s (%d polls), in the router's kernel for %s; pings lost: IPv4 %d, IPv6 %d",
				x, to.n.name, settled.Sub(began).Round(time.Millisecond), rib, poll.count(began, x), fib,
				p4.lostBetween(began, settled), p6.lostBetween(began, settled))
			require.LessOrEqual(t, rib, migrationBound, "FRR's table never held two next hops for %s longer than the bound", x)
			require.LessOrEqual(t, fib, migrationBound, "the router never forwarded %s to two nodes longer than the bound", x)
		}

		// The source pod's DEL changes nothing for the client.
		before := poll.after(t, time.Now(), len(m.x))
		hopsBefore := w.changes(0)
		delBegan := time.Now()
		require.NoError(t, m.vmNode.n.del(m.vmNode.l, source))
		waitFor(t, 20*time.Second, "the binding to lose its second owner (the source's DEL)", func() bool { return m.binding().Alternate == nil })
		p4.awaitAnswers(t, 20*time.Second, time.Now(), 20)
		p6.awaitAnswers(t, 20*time.Second, time.Now(), 20)
		seen := time.Now().Add(-time.Second) // requests answered by now, or lost
		require.Zero(t, p4.lostBetween(delBegan, seen), "no IPv4 ping lost to the source's DEL")
		require.Zero(t, p6.lostBetween(delBegan, seen), "no IPv6 ping lost to the source's DEL")
		require.Empty(t, poll.differentSince(delBegan, before), "FRR's paths to the VM's addresses stayed those of before the source's DEL")
		require.Equal(t, hopsBefore, w.changes(0), "the router's kernel changed no route to the VM's addresses")
		_, hasBlock := m.frr.nextHops("ipv4")[block]
		require.True(t, hasBlock, "node 1 still announces its block")
		m.vm, m.vmNode = target, to
	}

	move(mv2) // the /32 and /128 appear at node 2
	move(mv3) // and move from node 2 to node 3
	finish(p4, p6)
	for _, p := range []*pinger{p4, p6} {
		runs, sent := p.losses()
		t.Logf("pinger of %s: %d sent, loss runs %v", p.dst, sent, runs)
	}
}

// frrPoll polls FRR's table for some prefixes as fast as vtysh answers,
// recording each answer's next hops.
type frrPoll struct {
	mu    sync.Mutex
	polls []frrPollAt
}

type frrPollAt struct {
	at   time.Time
	p    netip.Prefix
	hops []netip.Addr
}

func pollFRRPaths(t testing.TB, f *frr, prefixes ...netip.Prefix) *frrPoll {
	fp := &frrPoll{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			for _, p := range prefixes {
				select {
				case <-done:
					return
				default:
				}
				// A poll is stamped when it was asked: under load vtysh
				// answers late, and what it says is FRR's table at some
				// moment after the question.
				at := time.Now()
				hops, err := f.frrPaths(p)
				if err != nil {
					continue
				}
				fp.mu.Lock()
				fp.polls = append(fp.polls, frrPollAt{at: at, p: p, hops: hops})
				fp.mu.Unlock()
			}
		}
	})
	t.Cleanup(func() { close(done); wg.Wait() })
	return fp
}

// longestOverlap is the longest run of polls since from, in time, that
// saw more than one next hop for x's host prefix: from the first such
// poll to the next that saw one or none.
func (fp *frrPoll) longestOverlap(from time.Time, x netip.Addr) time.Duration {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	var longest time.Duration
	var began time.Time
	for _, p := range fp.polls {
		if p.p.Addr() != x || p.at.Before(from) {
			continue
		}
		switch {
		case len(p.hops) > 1 && began.IsZero():
			began = p.at
		case len(p.hops) <= 1 && !began.IsZero():
			longest, began = max(longest, p.at.Sub(began)), time.Time{}
		}
	}
	if !began.IsZero() {
		longest = max(longest, time.Since(began))
	}
	return longest
}

// count is how many polls of x's host prefix were made since from.
func (fp *frrPoll) count(from time.Time, x netip.Addr) int {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	n := 0
	for _, p := range fp.polls {
		if p.p.Addr() == x && !p.at.Before(from) {
			n++
		}
	}
	return n
}

// differentSince lists the polls since from whose next hops differ
// from want's (last's answer) for their prefix.
func (fp *frrPoll) differentSince(from time.Time, want map[netip.Prefix]string) []string {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	var out []string
	for _, p := range fp.polls {
		if got := fmtAddrs(p.hops); !p.at.Before(from) && got != want[p.p] {
			out = append(out, p.at.Format("15:04:05.000")+" "+p.p.String()+" via "+got)
		}
	}
	return out
}

// after awaits, for each of the n prefixes polled, an answer to a poll
// asked after from, and returns each prefix's last such answer: FRR's
// table as it is now, not an answer to a question asked before (a poll
// asked during a move and answered late under load).
func (fp *frrPoll) after(t testing.TB, from time.Time, n int) map[netip.Prefix]string {
	t.Helper()
	out := map[netip.Prefix]string{}
	waitFor(t, 30*time.Second, "FRR to be polled again", func() bool {
		fp.mu.Lock()
		defer fp.mu.Unlock()
		for _, p := range fp.polls {
			if !p.at.Before(from) {
				out[p.p] = fmtAddrs(p.hops)
			}
		}
		return len(out) == n
	})
	return out
}

func fmtAddrs(as []netip.Addr) string {
	s := ""
	for i, a := range as {
		if i > 0 {
			s += ","
		}
		s += a.String()
	}
	return s
}
