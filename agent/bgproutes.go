package agent

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/agent/bgp"
)

// announcer is what routing bgp needs of a BGP speaker (bgp.Speaker):
// make the announced routes equal a set.
type announcer interface {
	Sync(ctx context.Context, want []bgp.Route) error
}

// bgpAnnouncer follows the block homes, as the peer router does, and has
// the speaker announce the homes this node holds: each block it claimed
// (one prefix) and each address it borrowed (a /32 or /128), with this
// node's address of the family as next hop. A home that moves to another
// node (a block given back and claimed elsewhere, a claim lost with the
// node's lease and taken over) is withdrawn. It announces nothing until
// the first full list is in: a restarted agent's first set is complete,
// so the routers, which kept its routes (graceful restart), see nothing
// change.
type bgpAnnouncer struct {
	node     string
	source   homeSource
	speaker  announcer
	nextHop4 netip.Addr
	nextHop6 netip.Addr
	log      hclog.Logger

	homes homesMirror // block or lent address -> home node
	loop  syncLoop
}

func newBGPAnnouncer(node string, addrs []string, source homeSource, speaker announcer, log hclog.Logger) *bgpAnnouncer {
	a := &bgpAnnouncer{node: node, source: source, speaker: speaker, log: log, loop: newSyncLoop("bgp announcements", log)}
	a.homes.kick = a.loop.kick
	for _, s := range addrs {
		ad, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		switch {
		case ad.Is4() && !a.nextHop4.IsValid():
			a.nextHop4 = ad
		case ad.Is6() && !a.nextHop6.IsValid():
			a.nextHop6 = ad
		}
	}
	return a
}

func (a *bgpAnnouncer) run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { _ = a.source.WatchHomes(ctx, &a.homes) })
	defer wg.Wait()
	a.loop.run(ctx, func() (bool, error) {
		want, ok := a.desired()
		if !ok {
			return false, nil
		}
		return true, a.speaker.Sync(ctx, want)
	})
}

// desired is this node's homes with their next hops; false until the
// first list is in.
func (a *bgpAnnouncer) desired() ([]bgp.Route, bool) {
	homes, listed := a.homes.homes.snapshot()
	if !listed {
		return nil, false
	}
	var out []bgp.Route
	for p, node := range homes {
		if node != a.node {
			continue
		}
		nh := a.nextHop6
		if p.Addr().Is4() {
			nh = a.nextHop4
		}
		out = append(out, bgp.Route{Prefix: p, NextHop: nh})
	}
	return out, true
}

func (a *bgpAnnouncer) changed() { a.loop.changed() }

// bgpRestarting reports whether this boot's agent ran the speaker before
// (its boot ID is in stateDir): the node's forwarding state then survived,
// and the speaker says so in its OPEN (graceful restart). It records the
// boot ID for the next start.
func bgpRestarting(stateDir, bootID string) bool {
	f := filepath.Join(stateDir, "bgp-boot-id")
	b, err := os.ReadFile(f)
	restarting := err == nil && bootID != "" && strings.TrimSpace(string(b)) == bootID
	_ = os.MkdirAll(stateDir, 0o755)
	_ = os.WriteFile(f, []byte(bootID+"\n"), 0o644)
	return restarting
}

// startBGP starts the BGP speaker of routing bgp; it peers once the
// announcer has the node's homes. The agent never stops it: stopping
// would send each router a Cease, and routers withdraw a node's routes on
// a Cease; the sessions end with the process instead, a TCP close that a
// graceful-restart helper answers by keeping them (docs/routing.md).
func (a *Agent) startBGP(ctx context.Context, bootID string) error {
	var rid netip.Addr
	for _, s := range a.recorder.addrs {
		if ad, err := netip.ParseAddr(s); err == nil && ad.Is4() {
			rid = ad
			break
		}
	}
	sp, err := bgp.Start(ctx, a.cfg.BGP, bgp.Options{Node: a.cfg.Node, RouterID: rid, Restarting: bgpRestarting(a.cfg.StateDir, bootID),
		Logger: a.log.Named("bgp")})
	if err != nil {
		return err
	}
	a.speaker = sp
	a.m.reg.MustRegister(sp.Collector())
	return nil
}
