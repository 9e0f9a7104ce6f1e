// Package bgp is the agent's BGP speaker (routing bgp): it peers with the
// routers configured for the node and announces the prefixes the agent
// gives it (the node's blocks and borrowed addresses), IPv4 and IPv6 over
// MP-BGP, with graceful restart (RFC 4724). It is GoBGP v3
// (github.com/osrg/gobgp/v3) embedded as a library; the agent sees only
// Speaker's small interface: Sync the announced set, read Status, and
// collect metrics.
package bgp

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/duration"
)

// Config is the speaker's part of the agent configuration (the bgp: key
// of the agent's YAML file). The agent's YAML is read strictly, so an
// unknown key anywhere in it is an error, not a silently ignored setting.
type Config struct {
	// ASN is this node's autonomous system number (required).
	ASN ASN `json:"asn"`
	// RouterID is the BGP identifier; default the node's IPv4 address.
	RouterID string `json:"routerID"`
	// ListenPort is where the speaker accepts sessions; 0 (the default)
	// listens nowhere: the agent connects to its peers. A port below
	// net.ipv4.ip_unprivileged_port_start (1024), such as 179, needs
	// CAP_NET_BIND_SERVICE, which the DaemonSet does not add: Start
	// refuses it without (CheckListenPort).
	ListenPort int32 `json:"listenPort"`
	// Communities are added to every announcement: "65000:100" or a
	// well-known name (no-export, no-advertise, no-export-subconfed).
	Communities []string `json:"communities"`
	// LocalPref is the LOCAL_PREF of every announcement (iBGP peers only;
	// BGP sends no LOCAL_PREF to an external peer). 0 leaves it out.
	LocalPref uint32 `json:"localPref"`
	// RestartTime is how long a peer keeps this node's routes after the
	// session drops, while the agent restarts (RFC 4724); at most, and by
	// default, MaxRestartTime of the node's lease TTL (the agent sets it).
	RestartTime Duration `json:"restartTime"`
	// Peers are the routers to peer with.
	Peers []Peer `json:"peers"`
}

// Peer is one router.
type Peer struct {
	// Address is the router's address (required).
	Address string `json:"address"`
	// ASN is the router's AS number (required).
	ASN ASN `json:"asn"`
	// Port is the router's BGP port; default 179.
	Port uint32 `json:"port"`
	// Password turns TCP MD5 signatures (RFC 2385) on.
	Password string `json:"password"`
	// PasswordFile is a file holding the password instead (a Kubernetes
	// Secret mounted as a file), read when the agent starts; one trailing
	// newline is not part of it. At most one of Password and PasswordFile.
	PasswordFile string `json:"passwordFile"`
	// Multihop is the TTL of an eBGP session with a router that is not
	// on the node's subnet (a route server): 2-255. 0 (the default) sends
	// with TTL 1, as eBGP does, so that only a directly connected router
	// answers. iBGP sessions are not TTL-limited: refused there.
	Multihop uint32 `json:"multihop"`
	// HoldTime is proposed to the router (default 90s; 0s or at least 3s);
	// KeepaliveTime defaults to a third of it and must be below it.
	HoldTime      Duration `json:"holdTime"`
	KeepaliveTime Duration `json:"keepaliveTime"`
	// Communities are added to the announcements to this router, beside
	// the global ones; LocalPref, if set, replaces the global one for it.
	Communities []string `json:"communities"`
	LocalPref   uint32   `json:"localPref"`
	// Nodes, if set, are the node names (shell patterns: "rack1-*") that
	// peer with this router; empty is every node. One file then serves a
	// whole cluster (a DaemonSet's ConfigMap) with a router per rack.
	Nodes []string `json:"nodes"`
}

// Duration is a time.Duration written as the flags take it ("90s"); a
// bare number other than 0 is refused.
type Duration struct{ time.Duration }

// UnmarshalJSON reads a Go duration string (duration.Decode).
func (d *Duration) UnmarshalJSON(b []byte) (err error) {
	d.Duration, err = duration.Decode(b)
	return err
}

// MarshalJSON writes a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// DefaultHoldTime is a peer's hold time when none is given.
const DefaultHoldTime = 90 * time.Second

// holdTime is the hold time proposed to the router: HoldTime, or
// DefaultHoldTime when it is unset (0s).
func (p Peer) holdTime() time.Duration {
	if p.HoldTime.Duration == 0 {
		return DefaultHoldTime
	}
	return p.HoldTime.Duration
}

// keepaliveTime is the keepalive interval: KeepaliveTime, or a third of
// the hold time when it is unset.
func (p Peer) keepaliveTime() time.Duration {
	if p.KeepaliveTime.Duration == 0 {
		return p.holdTime() / 3
	}
	return p.KeepaliveTime.Duration
}

// MaxRestartTime is the longest graceful restart a node whose lease TTL is
// leaseTTL may ask of its routers: half the TTL, in whole seconds, at
// least one. The agent announces only while etcd provably keeps its lease
// for the restart time more, so the routers drop the routes of an agent
// that is gone before etcd can expire its lease and give its blocks to
// another node. Keepalives every third of the TTL keep the lease proven
// for two thirds of it; the sixth between is the margin a slow keepalive
// has before the node withdraws for nothing.
func MaxRestartTime(leaseTTL time.Duration) time.Duration {
	return max(time.Second, (leaseTTL / 2).Truncate(time.Second))
}

var wellKnownCommunities = map[string]uint32{
	"no-export":           0xFFFFFF01,
	"no-advertise":        0xFFFFFF02,
	"no-export-subconfed": 0xFFFFFF03,
}

// ParseCommunity reads "ASN:VALUE" (each 0-65535) or a well-known name.
func ParseCommunity(s string) (uint32, error) {
	if v, ok := wellKnownCommunities[strings.ToLower(s)]; ok {
		return v, nil
	}
	hi, lo, ok := strings.Cut(s, ":")
	if !ok {
		return 0, fmt.Errorf("community %q: want ASN:VALUE or no-export, no-advertise, no-export-subconfed", s)
	}
	a, err1 := strconv.ParseUint(hi, 10, 16)
	b, err2 := strconv.ParseUint(lo, 10, 16)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("community %q: each half must be 0-65535", s)
	}
	return uint32(a)<<16 | uint32(b), nil
}

// Validate reports every mistake at once, naming the field.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("bgp: "+format, args...)) }
	if c.ASN == 0 {
		bad("asn: required with routing bgp")
	} else if err := CheckASN(uint64(c.ASN)); err != nil {
		bad("asn: %w", err)
	}
	if c.RouterID != "" {
		if a, err := netip.ParseAddr(c.RouterID); err != nil || !a.Is4() {
			bad("routerID: %q is not an IPv4 address", c.RouterID)
		}
	}
	if c.ListenPort < 0 || c.ListenPort > 65535 {
		bad("listenPort: %d out of range 0-65535", c.ListenPort)
	}
	for _, s := range c.Communities {
		if _, err := ParseCommunity(s); err != nil {
			bad("communities: %w", err)
		}
	}
	if rt := c.RestartTime.Duration; rt != 0 && (rt < time.Second || rt > 4095*time.Second) {
		bad("restartTime: %s out of range 1s-4095s (unset: the default)", c.RestartTime)
	}
	if len(c.Peers) == 0 {
		bad("peers: at least one router is needed with routing bgp")
	}
	seen := map[netip.Addr]bool{}
	for i, p := range c.Peers {
		a, err := netip.ParseAddr(p.Address)
		if err != nil {
			bad("peers[%d].address: %q is not an IP address", i, p.Address)
		} else if seen[a] {
			bad("peers[%d].address: %s given twice", i, a)
		}
		seen[a] = true
		if p.ASN == 0 {
			bad("peers[%d].asn: required", i)
		} else if err := CheckASN(uint64(p.ASN)); err != nil {
			bad("peers[%d].asn: %w", i, err)
		}
		if p.Port > 65535 {
			bad("peers[%d].port: %d out of range", i, p.Port)
		}
		if p.Password != "" && p.PasswordFile != "" {
			bad("peers[%d]: password and passwordFile both given: one or the other", i)
		} else if err := checkPassword(p.Password); err != nil {
			bad("peers[%d].password: %w", i, err)
		}
		switch {
		case p.Multihop == 1 || p.Multihop > 255:
			bad("peers[%d].multihop: %d out of range 2-255 (0: directly connected)", i, p.Multihop)
		case p.Multihop != 0 && p.ASN == c.ASN:
			bad("peers[%d].multihop: for an eBGP router only (its asn %d is this node's: iBGP is not TTL-limited)", i, p.ASN)
		}
		h, k := p.HoldTime.Duration, p.KeepaliveTime.Duration
		if h != 0 && (h < 3*time.Second || h > 65535*time.Second || h%time.Second != 0) {
			bad("peers[%d].holdTime: %s must be whole seconds, at least 3s", i, h)
		}
		if k < 0 || k%time.Second != 0 {
			bad("peers[%d].keepaliveTime: %s must be whole seconds", i, k)
		} else if hold := p.holdTime(); k >= hold {
			// The router would drop the session before the first
			// keepalive came (RFC 4271 4.4: a third of the hold time is
			// the reasonable most).
			bad("peers[%d].keepaliveTime: %s is not below the hold time %s: the session would expire between keepalives (a third of it, the default, is usual)", i, k, hold)
		}
		for _, c := range p.Communities {
			if _, err := ParseCommunity(c); err != nil {
				bad("peers[%d].communities: %w", i, err)
			}
		}
		for _, pat := range p.Nodes {
			if _, err := path.Match(pat, ""); err != nil {
				bad("peers[%d].nodes: %q: %w", i, pat, err)
			}
		}
	}
	return errors.Join(errs...)
}

// PeersFor are the peers that node peers with.
func (c *Config) PeersFor(node string) []Peer {
	var out []Peer
	for _, p := range c.Peers {
		if len(p.Nodes) == 0 {
			out = append(out, p)
			continue
		}
		for _, pat := range p.Nodes {
			if ok, _ := path.Match(pat, node); ok {
				out = append(out, p)
				break
			}
		}
	}
	return out
}
