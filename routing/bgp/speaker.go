package bgp

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	api "github.com/osrg/gobgp/v3/api"
	"github.com/osrg/gobgp/v3/pkg/server"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// Route is one announcement: a prefix (a block, or a borrowed address as
// a /32 or /128) and the next hop routers send its traffic to (this
// node's address of the prefix's family).
type Route struct {
	Prefix  netip.Prefix
	NextHop netip.Addr
}

// Options are what the speaker needs besides its Config.
type Options struct {
	Node string
	// RouterID is the BGP identifier when Config.RouterID is empty.
	RouterID netip.Addr
	// Restarting says the node's forwarding state (its pods and their
	// routes) survived since the speaker last ran: the OPEN then sets the
	// Restart State and Forwarding State bits (RFC 4724), and routers keep
	// the node's routes until its End-of-RIB, instead of dropping them.
	Restarting bool
	Logger     hclog.Logger
}

// Speaker is one node's BGP speaker.
type Speaker struct {
	cfg   Config
	opts  Options
	peers []Peer
	srv   *server.BgpServer
	log   hclog.Logger
	attrs []*anypb.Any // communities and local-pref of every announcement
	// sessions says why each session is not established.
	sessions *sessions

	mu        sync.Mutex
	announced map[netip.Prefix]netip.Addr // prefix -> next hop
	peered    bool
}

var (
	familyV4 = &api.Family{Afi: api.Family_AFI_IP, Safi: api.Family_SAFI_UNICAST}
	familyV6 = &api.Family{Afi: api.Family_AFI_IP6, Safi: api.Family_SAFI_UNICAST}
)

// Start starts the speaker. It peers with no router until the first Sync,
// so that the End-of-RIB a router gets follows every route the node has.
func Start(ctx context.Context, cfg Config, o Options) (*Speaker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if o.Logger == nil {
		o.Logger = hclog.NewNullLogger()
	}
	rid := o.RouterID
	if cfg.RouterID != "" {
		rid = netip.MustParseAddr(cfg.RouterID)
	}
	if !rid.Is4() {
		return nil, errors.New("bgp: no router ID: set bgp.routerID, or give the node an IPv4 address (--node-address)")
	}
	if cfg.RestartTime.Duration < time.Second {
		return nil, errors.New("bgp: restartTime: at least 1s (the agent gives MaxRestartTime of its lease TTL)")
	}
	s := &Speaker{cfg: cfg, opts: o, peers: cfg.PeersFor(o.Node), log: o.Logger, announced: map[netip.Prefix]netip.Addr{}}
	if err := resolvePasswords(s.peers); err != nil {
		return nil, err
	}
	s.sessions = newSessions(o.Logger, s.probes(rid))
	if err := CheckListenPort(cfg.ListenPort); err != nil {
		return nil, err
	}
	var comms []uint32
	for _, c := range cfg.Communities {
		v, _ := ParseCommunity(c)
		comms = append(comms, v)
	}
	if len(comms) > 0 {
		a, err := anypb.New(&api.CommunitiesAttribute{Communities: comms})
		if err != nil {
			return nil, fmt.Errorf("bgp: communities: %w", err)
		}
		s.attrs = append(s.attrs, a)
	}
	if cfg.LocalPref != 0 {
		a, err := anypb.New(&api.LocalPrefAttribute{LocalPref: cfg.LocalPref})
		if err != nil {
			return nil, fmt.Errorf("bgp: local-pref: %w", err)
		}
		s.attrs = append(s.attrs, a)
	}
	s.srv = server.NewBgpServer(server.LoggerOption(logAdapter{l: o.Logger, s: s.sessions}))
	go s.srv.Serve()
	listen := cfg.ListenPort
	if listen == 0 {
		listen = -1 // GoBGP's "listen nowhere"
	}
	err := s.srv.StartBgp(ctx, &api.StartBgpRequest{Global: &api.Global{
		Asn: uint32(cfg.ASN), RouterId: rid.String(), ListenPort: listen,
		GracefulRestart: &api.GracefulRestart{Enabled: true, RestartTime: uint32(cfg.RestartTime.Seconds())},
	}})
	if err != nil {
		s.srv.Stop()
		return nil, fmt.Errorf("bgp: start: %w", err)
	}
	if err := s.exportPolicy(ctx); err != nil {
		s.srv.Stop()
		return nil, err
	}
	if err := s.rejectLearned(ctx); err != nil {
		s.srv.Stop()
		return nil, err
	}
	s.log.Info("bgp speaker started", "asn", cfg.ASN, "router_id", rid, "peers", len(s.peers), "restarting", o.Restarting)
	for _, p := range s.peers {
		if k, h := p.keepaliveTime(), p.holdTime(); k > h/3 {
			s.log.Warn("bgp keepalive interval is more than a third of the hold time: one late keepalive can expire the session (RFC 4271 suggests a third)",
				"peer", p.Address, "keepalive_time", k, "hold_time", h)
		}
	}
	return s, nil
}

// probes are the probe connections that look to each peer like its
// session (openProbe), by its address as GoBGP names it.
func (s *Speaker) probes(rid netip.Addr) map[string]openProbe {
	out := map[string]openProbe{}
	for _, p := range s.peers {
		port := p.Port
		if port == 0 {
			port = 179
		}
		ttl := 0 // iBGP: the system's default
		if p.ASN != s.cfg.ASN {
			ttl = max(1, int(p.Multihop))
		}
		out[p.Address] = openProbe{addr: netip.MustParseAddr(p.Address), port: port, password: p.Password, ttl: ttl,
			localAS: uint32(s.cfg.ASN), hold: p.holdTime(), routerID: rid}
	}
	return out
}

// RestartTime is how long routers keep this node's routes after its
// sessions drop (graceful restart), as the speaker tells them.
func (s *Speaker) RestartTime() time.Duration { return s.cfg.RestartTime.Duration }

// Sync makes the announced routes equal want: it announces what is new
// or has a new next hop and withdraws what is gone. The first Sync then
// adds the peers.
func (s *Speaker) Sync(ctx context.Context, want []Route) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	next := make(map[netip.Prefix]netip.Addr, len(want))
	for _, r := range want {
		next[r.Prefix.Masked()] = r.NextHop
	}
	for p, nh := range s.announced {
		if cur, ok := next[p]; ok && cur == nh {
			continue
		}
		if err := s.srv.DeletePath(ctx, &api.DeletePathRequest{TableType: api.TableType_GLOBAL, Family: family(p), Path: s.path(p, nh)}); err != nil {
			errs = append(errs, fmt.Errorf("bgp: withdraw %s: %w", p, err))
			continue
		}
		delete(s.announced, p)
		s.log.Info("bgp withdrew", "prefix", p)
	}
	for p, nh := range next {
		if _, ok := s.announced[p]; ok {
			continue
		}
		if !nh.IsValid() || nh.Is4() != p.Addr().Is4() {
			errs = append(errs, fmt.Errorf("bgp: %s: this node has no address of its family to be the next hop", p))
			continue
		}
		if _, err := s.srv.AddPath(ctx, &api.AddPathRequest{TableType: api.TableType_GLOBAL, Path: s.path(p, nh)}); err != nil {
			errs = append(errs, fmt.Errorf("bgp: announce %s: %w", p, err))
			continue
		}
		s.announced[p] = nh
		s.log.Info("bgp announced", "prefix", p, "next_hop", nh)
	}
	if !s.peered {
		for _, p := range s.peers {
			if err := s.srv.AddPeer(ctx, &api.AddPeerRequest{Peer: s.peer(p)}); err != nil {
				errs = append(errs, fmt.Errorf("bgp: add peer %s: %w", p.Address, err))
				continue
			}

			s.log.Info("bgp peer added", "peer", p.Address, "asn", p.ASN)
		}
		s.peered = true
	}
	return errors.Join(errs...)
}

// exportPolicy adds each peer's own communities and local-pref to what
// is sent to it: one global export policy with a statement per such peer,
// matched by a neighbour set (GoBGP has per-peer policies for
// route-server clients only). It is in place before any peer is added.
func (s *Speaker) exportPolicy(ctx context.Context) error {
	var stmts []*api.Statement
	for i, p := range s.peers {
		if len(p.Communities) == 0 && p.LocalPref == 0 {
			continue
		}
		a := netip.MustParseAddr(p.Address)
		set := fmt.Sprintf("kvipam-peer-%d", i)
		err := s.srv.AddDefinedSet(ctx, &api.AddDefinedSetRequest{DefinedSet: &api.DefinedSet{
			DefinedType: api.DefinedType_NEIGHBOR, Name: set, List: []string{netip.PrefixFrom(a, a.BitLen()).String()}}})
		if err != nil {
			return fmt.Errorf("bgp: peer %s: neighbour set: %w", p.Address, err)
		}
		act := &api.Actions{RouteAction: api.RouteAction_ACCEPT}
		if len(p.Communities) > 0 {
			var cs []string
			for _, c := range p.Communities {
				v, _ := ParseCommunity(c)
				cs = append(cs, fmt.Sprintf("%d:%d", v>>16, v&0xffff))
			}
			act.Community = &api.CommunityAction{Type: api.CommunityAction_ADD, Communities: cs}
		}
		if p.LocalPref != 0 {
			act.LocalPref = &api.LocalPrefAction{Value: p.LocalPref}
		}
		stmts = append(stmts, &api.Statement{Name: set, Actions: act,
			Conditions: &api.Conditions{NeighborSet: &api.MatchSet{Name: set, Type: api.MatchSet_ANY}}})
	}
	if len(stmts) == 0 {
		return nil
	}
	const name = "kvipam-peers"
	if err := s.srv.AddPolicy(ctx, &api.AddPolicyRequest{Policy: &api.Policy{Name: name, Statements: stmts}}); err != nil {
		return fmt.Errorf("bgp: export policy: %w", err)
	}
	err := s.srv.AddPolicyAssignment(ctx, &api.AddPolicyAssignmentRequest{Assignment: &api.PolicyAssignment{
		Name: "global", Direction: api.PolicyDirection_EXPORT, Policies: []*api.Policy{{Name: name}}, DefaultAction: api.RouteAction_ACCEPT}})
	if err != nil {
		return fmt.Errorf("bgp: assign export policy: %w", err)
	}
	return nil
}

// rejectLearned keeps the routes a router sends out of the speaker's
// table: the node installs none (the fabric routes pod traffic), so
// there is no best path to compute for them. GoBGP still holds what it
// received (its Adj-RIB-In), so routers should send the nodes nothing
// (docs/routing.md). It is a global import policy that rejects every
// path from a neighbour; the node's own paths have none.
func (s *Speaker) rejectLearned(ctx context.Context) error {
	const set, name = "kvipam-any-neighbour", "kvipam-reject-learned"
	err := s.srv.AddDefinedSet(ctx, &api.AddDefinedSetRequest{DefinedSet: &api.DefinedSet{
		DefinedType: api.DefinedType_NEIGHBOR, Name: set, List: []string{"0.0.0.0/0", "::/0"}}})
	if err != nil {
		return fmt.Errorf("bgp: neighbour set: %w", err)
	}
	err = s.srv.AddPolicy(ctx, &api.AddPolicyRequest{Policy: &api.Policy{Name: name, Statements: []*api.Statement{{Name: name,
		Conditions: &api.Conditions{NeighborSet: &api.MatchSet{Name: set, Type: api.MatchSet_ANY}},
		Actions:    &api.Actions{RouteAction: api.RouteAction_REJECT}}}}})
	if err != nil {
		return fmt.Errorf("bgp: import policy: %w", err)
	}
	err = s.srv.AddPolicyAssignment(ctx, &api.AddPolicyAssignmentRequest{Assignment: &api.PolicyAssignment{
		Name: "global", Direction: api.PolicyDirection_IMPORT, Policies: []*api.Policy{{Name: name}}, DefaultAction: api.RouteAction_ACCEPT}})
	if err != nil {
		return fmt.Errorf("bgp: assign import policy: %w", err)
	}
	return nil
}

func family(p netip.Prefix) *api.Family {
	if p.Addr().Is4() {
		return familyV4
	}
	return familyV6
}

// path is the GoBGP path of one announcement.
func (s *Speaker) path(p netip.Prefix, nh netip.Addr) *api.Path {
	nlri, _ := anypb.New(&api.IPAddressPrefix{Prefix: p.Addr().String(), PrefixLen: uint32(p.Bits())})
	origin, _ := anypb.New(&api.OriginAttribute{Origin: 0}) // IGP
	attrs := []*anypb.Any{origin}
	if p.Addr().Is4() {
		a, _ := anypb.New(&api.NextHopAttribute{NextHop: nh.String()})
		attrs = append(attrs, a)
	} else {
		a, _ := anypb.New(&api.MpReachNLRIAttribute{Family: familyV6, NextHops: []string{nh.String()}, Nlris: []*anypb.Any{nlri}})
		attrs = append(attrs, a)
	}
	for _, a := range s.attrs {
		attrs = append(attrs, proto.Clone(a).(*anypb.Any))
	}
	return &api.Path{Family: family(p), Nlri: nlri, Pattrs: attrs}
}

func (s *Speaker) peer(p Peer) *api.Peer {
	hold, keep := p.holdTime(), p.keepaliveTime()
	afi := func(f *api.Family) *api.AfiSafi {
		return &api.AfiSafi{Config: &api.AfiSafiConfig{Family: f, Enabled: true},
			MpGracefulRestart: &api.MpGracefulRestart{Config: &api.MpGracefulRestartConfig{Enabled: true}}}
	}
	return &api.Peer{
		Conf: &api.PeerConf{NeighborAddress: p.Address, PeerAsn: uint32(p.ASN), AuthPassword: p.Password},
		Timers: &api.Timers{Config: &api.TimersConfig{HoldTime: uint64(hold.Seconds()), KeepaliveInterval: uint64(keep.Seconds()),
			ConnectRetry: 5}},
		Transport: &api.Transport{RemotePort: p.Port},
		GracefulRestart: &api.GracefulRestart{Enabled: true, RestartTime: uint32(s.RestartTime().Seconds()),
			LocalRestarting: s.opts.Restarting},
		AfiSafis:     []*api.AfiSafi{afi(familyV4), afi(familyV6)},
		EbgpMultihop: multihop(p),
	}
}

// multihop is GoBGP's TTL setting of an eBGP session with a router that
// is not directly connected (Peer.Multihop); nil keeps TTL 1.
func multihop(p Peer) *api.EbgpMultihop {
	if p.Multihop == 0 {
		return nil
	}
	return &api.EbgpMultihop{Enabled: true, MultihopTtl: p.Multihop}
}

// Stop ends every session with a Cease and withdraws nothing from etcd:
// for a node taken out of service. An agent that only restarts does not
// call it: its sessions end with its process, a TCP close that a
// graceful-restart helper answers by keeping the node's routes.
func (s *Speaker) Stop(ctx context.Context) error {
	err := s.srv.StopBgp(ctx, &api.StopBgpRequest{})
	s.srv.Stop()
	s.sessions.stop()
	return err
}
