package bgp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	gobgplog "github.com/osrg/gobgp/v3/pkg/log"
	"github.com/osrg/gobgp/v3/pkg/packet/bgp"
)

// DownReason is why a session is not established: Class is short and
// bounded (the metric's label: "connect: timeout", "notification sent:
// OPEN Message Error / Bad Peer AS"), Detail says it for a person, with
// what to check, and Since is when it was first seen.
type DownReason struct {
	Class, Detail string
	Since         time.Time
	probed        bool // read on a probe connection (openProbe)
}

// warnEvery is how often a reason that has not changed is logged again.
const warnEvery = time.Minute

// sessions keeps, for each peer, why its session is not established, from
// the events GoBGP reports through its logger: GoBGP v3's API has the
// session state and message counters but no reason (its peer events and
// ListPeer leave the FSM's reason out), so the speaker reads the typed
// fields of those events (the dial error, the NOTIFICATION's code and
// subcode), never the text of a message. A router's NOTIFICATION that
// ends the OPEN exchange, which GoBGP does not decode, is read on a probe
// connection (openProbe), at most every warnEvery per peer. It warns once
// per peer when a reason appears or changes, and again at most every
// warnEvery while it lasts; GoBGP tries to connect every 5-10 s. It is
// safe for concurrent use (GoBGP logs from each peer's goroutines); stop
// ends its probes.
type sessions struct {
	log    hclog.Logger
	now    func() time.Time
	probes map[string]openProbe // by peer address

	ctx    context.Context // the probes' lifetime
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu    sync.Mutex
	peers map[string]*session
}

type session struct {
	reason   DownReason
	notified bool // a NOTIFICATION was sent or received since the connection opened
	up       bool // established
	warnedAt time.Time
	repeats  int // events with the same reason since the last warning
	probing  bool
	probedAt time.Time
}

func newSessions(log hclog.Logger, probes map[string]openProbe) *sessions {
	ctx, cancel := context.WithCancel(context.Background())
	return &sessions{log: log, now: time.Now, probes: probes, ctx: ctx, cancel: cancel, peers: map[string]*session{}}
}

// stop ends the probes and waits for them.
func (s *sessions) stop() {
	s.cancel()
	s.wg.Wait()
}

// reason is why peer's session is not established; false while it is, or
// while nothing has gone wrong yet.
func (s *sessions) reason(peer string) (DownReason, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.peers[peer]
	if p == nil || p.reason.Class == "" {
		return DownReason{}, false
	}
	return p.reason, true
}

// observe reads one GoBGP log event; it reports whether the event is one
// the speaker turns into a reason, and so logs itself.
func (s *sessions) observe(msg string, f gobgplog.Fields) bool {
	if f["Topic"] != "Peer" {
		return false
	}
	peer, _ := f["Key"].(string)
	if peer == "" {
		return false
	}
	switch msg {
	case "failed to connect":
		err, _ := f["Error"].(error)
		s.set(peer, connectReason(err))
	case "sent notification":
		if e, ok := f["Data"].(*bgp.MessageError); ok {
			name := notificationName(e.TypeCode, e.SubTypeCode)
			s.notify(peer, DownReason{Class: "notification sent: " + name, Detail: "sent NOTIFICATION " + name + ": " + e.Message})
		}
	case "received notification":
		code, _ := f["Code"].(uint8)
		sub, _ := f["Subcode"].(uint8)
		name := notificationName(code, sub)
		detail := "received NOTIFICATION " + name + " from the router"
		if c, _ := f["Communicated-Reason"].(string); c != "" {
			detail += ": " + c
		}
		s.notify(peer, DownReason{Class: "notification received: " + name, Detail: detail})
	case "state changed":
		old, _ := f["old"].(string)
		next, _ := f["new"].(string)
		s.stateChanged(peer, old, next, fmt.Sprint(f["reason"]))
		return false
	default:
		return false
	}
	return true
}

// connectReason says why a connection to the router failed.
func connectReason(err error) DownReason {
	if err == nil {
		return DownReason{Class: "connect: error", Detail: "cannot connect to the router"}
	}
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return DownReason{Class: "connect: refused", Detail: "cannot connect: " + err.Error() +
			" (nothing listens there: is BGP configured on the router, on this port?)"}
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return DownReason{Class: "connect: unreachable", Detail: "cannot connect: " + err.Error() + " (no route to the router's address)"}
	case errors.As(err, &ne) && ne.Timeout():
		return DownReason{Class: "connect: timeout", Detail: "cannot connect: " + err.Error() +
			" (no answer: the router is down, unreachable or filtered, or its TCP MD5 password differs from this peer's, or one side has none)"}
	}
	return DownReason{Class: "connect: error", Detail: "cannot connect: " + err.Error()}
}

// notify records a NOTIFICATION of the current connection as the reason.
func (s *sessions) notify(peer string, r DownReason) {
	s.mu.Lock()
	p := s.get(peer)
	p.notified = true
	s.mu.Unlock()
	s.set(peer, r)
}

// stateChanged follows the FSM: a new connection forgets its
// predecessor's NOTIFICATION, an established session clears the reason,
// and a session that ends without a NOTIFICATION GoBGP decoded gets the
// FSM's own reason.
func (s *sessions) stateChanged(peer, old, next, why string) {
	s.mu.Lock()
	p := s.get(peer)
	notified := p.notified
	p.up = next == "BGP_FSM_ESTABLISHED"
	switch next {
	case "BGP_FSM_OPENSENT":
		p.notified = false
	case "BGP_FSM_ESTABLISHED":
		had := p.reason
		p.reason, p.notified, p.repeats = DownReason{}, false, 0
		s.mu.Unlock()
		if had.Class != "" {
			s.log.Info("bgp session established", "peer", peer, "down_since", had.Since.Format(time.RFC3339), "was", had.Detail)
		}
		return
	}
	s.mu.Unlock()
	if next != "BGP_FSM_IDLE" || notified || why == "dying" || why == "admin-down" {
		return // the speaker itself stops the session: no fault
	}
	switch {
	case old == "BGP_FSM_OPENSENT" || old == "BGP_FSM_OPENCONFIRM":
		// A message other than OPEN or KEEPALIVE ended the OPEN exchange:
		// the router's NOTIFICATION, which GoBGP v3 reads but does not
		// decode before the session is established.
		s.openRefused(peer, why)
	case old == "BGP_FSM_ESTABLISHED" && strings.HasPrefix(why, "hold-timer-expired"):
		s.set(peer, DownReason{Class: "hold timer expired", Detail: "hold timer expired: nothing from the router within the hold time"})
	case old == "BGP_FSM_ESTABLISHED" && why == "read-failed":
		s.set(peer, DownReason{Class: "connection closed", Detail: "the router closed the connection (read-failed)"})
	case old == "BGP_FSM_ESTABLISHED":
		s.set(peer, DownReason{Class: "session ended", Detail: "the session ended: " + why})
	}
}

// openRefused gives the reason of a session the router ended in the
// OPEN exchange: the NOTIFICATION a probe connection reads (due every
// warnEvery; meanwhile the last one read stands), or, when no probe can
// read one, what is known without it.
func (s *sessions) openRefused(peer, why string) {
	s.mu.Lock()
	p := s.get(peer)
	probe, ok := s.probes[peer]
	switch {
	case p.probing:
		s.mu.Unlock()
		return // the probe sets the reason
	case ok && (p.probedAt.IsZero() || s.now().Sub(p.probedAt) >= warnEvery):
		p.probing, p.probedAt = true, s.now()
		s.mu.Unlock()
		s.wg.Go(func() { s.probe(peer, probe, why) })
		return
	case p.reason.probed:
		r := p.reason
		s.mu.Unlock()
		s.set(peer, r)
		return
	}
	s.mu.Unlock()
	s.set(peer, openClosed(why, ""))
}

// probeDelay is how long after a session ended in the OPEN exchange its
// probe connects: routers refuse connections for a few seconds after they
// refused an OPEN (GoBGP for 5 s, its idle hold time), and the session's
// next attempt, which the probe should not meet, comes 6-7 s after.
const probeDelay = 5500 * time.Millisecond

// probe runs a probe connection and makes what it read peer's reason.
func (s *sessions) probe(peer string, probe openProbe, why string) {
	select {
	case <-s.ctx.Done():
		return
	case <-time.After(probeDelay):
	}
	ans, err := probe.run(s.ctx)
	s.mu.Lock()
	p := s.get(peer)
	p.probing = false
	up := p.up
	s.mu.Unlock()
	if up || s.ctx.Err() != nil {
		return
	}
	if err != nil {
		s.log.Debug("bgp probe of the OPEN exchange read no NOTIFICATION", "peer", peer, "error", err)
		s.set(peer, openClosed(why, err.Error()))
		return
	}
	name := notificationName(ans.code, ans.subcode)
	s.set(peer, DownReason{Class: "notification received: " + name, probed: true,
		Detail: "received NOTIFICATION " + name + " from the router in answer to this node's OPEN" + openHint(ans, probe) +
			" (read on a probe connection: GoBGP does not decode a NOTIFICATION before the session is established)"})
}

// openClosed is the reason of a session the router ended in the OPEN
// exchange when no probe read its NOTIFICATION (probeErr says why not).
func openClosed(why, probeErr string) DownReason {
	d := "the router ended the session in the OPEN exchange (" + why +
		"), with a NOTIFICATION GoBGP does not decode before a session is established: the router's log names it. " +
		"Usual causes: this node's bgp.asn is not the AS the router expects of it, or the router has no neighbor for this node's address"
	if probeErr != "" {
		d += " (a probe connection read none: " + probeErr + ")"
	}
	return DownReason{Class: "closed in OPEN exchange", Detail: d}
}

// openHint says what to check for the NOTIFICATIONs a router answers a
// misconfigured OPEN with.
func openHint(ans notificationAnswer, probe openProbe) string {
	switch {
	case ans.code == 2 && ans.subcode == 2:
		return fmt.Sprintf(": the router expects another AS of this node than bgp.asn %d", probe.localAS)
	case ans.code == 2 && ans.subcode == 3:
		return fmt.Sprintf(": the router refuses this node's BGP identifier %s (bgp.routerID)", probe.routerID)
	case ans.code == 2 && ans.subcode == 6:
		return fmt.Sprintf(": the router refuses the hold time %s (holdTime)", probe.hold)
	case ans.code == 6 && ans.subcode == 5:
		return ": the router refuses connections from this node (has it a neighbor for this node's address?)"
	}
	return ""
}

// set makes r peer's reason, and warns when it is new or changed, or
// when warnEvery has passed since the last warning.
func (s *sessions) set(peer string, r DownReason) {
	s.mu.Lock()
	p := s.get(peer)
	now := s.now()
	changed := p.reason.Class != r.Class || p.reason.Detail != r.Detail
	if changed {
		r.Since = now
		p.reason = r
	}
	p.repeats++
	warn := changed || now.Sub(p.warnedAt) >= warnEvery
	repeats := p.repeats
	since := p.reason.Since
	if warn {
		p.warnedAt, p.repeats = now, 0
	}
	s.mu.Unlock()
	if !warn {
		return
	}
	if changed {
		s.log.Warn("bgp session not established", "peer", peer, "reason", r.Detail)
		return
	}
	s.log.Warn("bgp session still not established", "peer", peer, "reason", r.Detail,
		"since", since.Format(time.RFC3339), "attempts", repeats)
}

// get is peer's entry; s.mu is held.
func (s *sessions) get(peer string) *session {
	p := s.peers[peer]
	if p == nil {
		p = &session{}
		s.peers[peer] = p
	}
	return p
}
