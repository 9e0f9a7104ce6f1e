package bgp

import (
	"context"
	"sort"
	"time"

	agentapi "github.com/kvipam/kvipam/agent/api"

	api "github.com/osrg/gobgp/v3/api"
	"google.golang.org/protobuf/types/known/anypb"
)

// Status and PeerStatus are the agent API's (GET /v1/status): one
// definition of the wire contract, which kvipamctl reads.
type (
	Status     = agentapi.BGPStatus
	PeerStatus = agentapi.BGPPeerStatus
)

// Status reads the peers' states from the speaker.
func (s *Speaker) Status(ctx context.Context) Status {
	st := Status{ASN: uint32(s.cfg.ASN), Announced: map[string]int{"ipv4": 0, "ipv6": 0}}
	s.mu.Lock()
	for p := range s.announced {
		st.Announced[familyName(p.Addr().Is4())]++
	}
	s.mu.Unlock()
	err := s.srv.ListPeer(ctx, &api.ListPeerRequest{EnableAdvertised: true}, func(p *api.Peer) {
		ps := PeerStatus{Advertised: map[string]uint64{}, Received: map[string]uint64{}}
		if p.Conf != nil {
			ps.Address, ps.ASN = p.Conf.NeighborAddress, p.Conf.PeerAsn
		}
		if p.State != nil {
			ps.State = sessionState(p.State.SessionState)
		}
		if r, ok := s.sessions.reason(ps.Address); ok && ps.State != "established" {
			ps.Reason, ps.ReasonClass, ps.ReasonSince = r.Detail, r.Class, r.Since
		}
		eor := ps.State == "established" && restartCapable(p.GetState().GetRemoteCap())
		if p.Timers != nil && p.Timers.State != nil && p.Timers.State.Uptime != nil && ps.State == "established" {
			ps.Uptime = time.Since(p.Timers.State.Uptime.AsTime()).Round(time.Second)
		}
		for _, a := range p.AfiSafis {
			if a.State == nil || a.State.Family == nil {
				continue
			}
			f := familyName(a.State.Family.Afi == api.Family_AFI_IP)
			// GoBGP counts what it would send the peer now, sent or not, and
			// the End-of-RIB marker of a graceful-restart session as a path:
			// nothing was sent on a session that is not established.
			adv := a.State.Advertised
			switch {
			case ps.State != "established":
				adv = 0
			case eor && adv > 0:
				adv--
			}
			ps.Advertised[f], ps.Received[f] = adv, a.State.Received
		}
		st.Peers = append(st.Peers, ps)
	})
	if err != nil {
		st.Error = err.Error()
	}
	sort.Slice(st.Peers, func(i, j int) bool { return st.Peers[i].Address < st.Peers[j].Address })
	return st
}

// restartCapable reports whether the router announced graceful restart
// (its OPEN's capability): GoBGP then sends it End-of-RIB markers.
func restartCapable(caps []*anypb.Any) bool {
	for _, c := range caps {
		if c.MessageIs(&api.GracefulRestartCapability{}) {
			return true
		}
	}
	return false
}

func familyName(v4 bool) string {
	if v4 {
		return "ipv4"
	}
	return "ipv6"
}

func sessionState(s api.PeerState_SessionState) string {
	switch s {
	case api.PeerState_IDLE:
		return "idle"
	case api.PeerState_CONNECT:
		return "connect"
	case api.PeerState_ACTIVE:
		return "active"
	case api.PeerState_OPENSENT:
		return "opensent"
	case api.PeerState_OPENCONFIRM:
		return "openconfirm"
	case api.PeerState_ESTABLISHED:
		return "established"
	}
	return "unknown"
}
