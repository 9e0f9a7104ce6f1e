package bgp

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBGPKeepaliveLongerThanHoldRefused: a keepalive interval that is not
// below the hold time proposed to the router, given or the default 90s,
// is refused by the key's name: the router would expire the session
// between two keepalives. Below it is accepted (more than a third only
// warns at start).
func TestBGPKeepaliveLongerThanHoldRefused(t *testing.T) {
	for _, tc := range []struct {
		name            string
		hold, keepalive time.Duration
		refused         bool
	}{
		{"equal", 9 * time.Second, 9 * time.Second, true},
		{"longer", 9 * time.Second, 30 * time.Second, true},
		{"longer than the default hold", 0, 120 * time.Second, true},
		{"the default hold itself", 0, 90 * time.Second, true},
		{"a third", 9 * time.Second, 3 * time.Second, false},
		{"more than a third, below", 9 * time.Second, 4 * time.Second, false},
		{"below the default hold", 0, 60 * time.Second, false},
		{"both defaults", 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{ASN: 65001, Peers: []Peer{{Address: "10.0.0.1", ASN: 65000,
				HoldTime: Duration{tc.hold}, KeepaliveTime: Duration{tc.keepalive}}}}
			err := c.Validate()
			if !tc.refused {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, "peers[0].keepaliveTime")
			require.ErrorContains(t, err, "not below the hold time")
		})
	}
}

// TestBGPASNChecked: an AS number outside 1-4294967294, or one an RFC
// reserves (AS_TRANS among them), is refused with the reason, both when
// the file is read (ASN decodes itself) and by Validate; private and
// 4-octet numbers are accepted.
func TestBGPASNChecked(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string // "" accepted
	}{
		{"65001", ""},
		{"4200000000", ""},
		{"64496", ""},
		{"0", "reserved (RFC 7607)"},
		{"23456", "AS_TRANS"},
		{"65535", "RFC 7300"},
		{"70000", "reserved by IANA"},
		{"4294967295", "RFC 7300"},
		{"4294967296", "at most 4294967294"},
		{"-1", "whole number"},
		{"6.5", "whole number"},
		{"true", "want a number"},
	} {
		var a ASN
		err := a.UnmarshalJSON([]byte(tc.in))
		if tc.want == "" {
			require.NoError(t, err, tc.in)
			continue
		}
		require.ErrorContains(t, err, tc.want, tc.in)
	}
	c := Config{ASN: 23456, Peers: []Peer{{Address: "10.0.0.1", ASN: 65535}}}
	err := c.Validate()
	require.ErrorContains(t, err, "bgp: asn: 23456 is not a usable AS number")
	require.ErrorContains(t, err, "bgp: peers[0].asn: 65535 is not a usable AS number")
}

// TestBGPListenPortNeedsCapability: a listen port below the unprivileged
// start is refused, by its key and with the way out, without
// CAP_NET_BIND_SERVICE; with it, or from the start, or 0, it is not.
func TestBGPListenPortNeedsCapability(t *testing.T) {
	err := checkListenPort(179, 1024, false)
	require.ErrorContains(t, err, "bgp: listenPort: 179 is below 1024")
	require.ErrorContains(t, err, "CAP_NET_BIND_SERVICE")
	require.NoError(t, checkListenPort(179, 1024, true))
	require.NoError(t, checkListenPort(1179, 1024, false))
	require.NoError(t, checkListenPort(179, 0, false), "a lowered ip_unprivileged_port_start")
	require.NoError(t, CheckListenPort(0), "connect out only")
}

// TestBGPPeerSettingsChecked: multihop only for eBGP and within 2-255,
// one password source at most, and an MD5 key Linux can take.
func TestBGPPeerSettingsChecked(t *testing.T) {
	for _, tc := range []struct {
		name string
		peer Peer
		want string
	}{
		{"multihop ebgp", Peer{Multihop: 4}, ""},
		{"multihop 1", Peer{Multihop: 1}, "multihop: 1 out of range 2-255"},
		{"multihop 256", Peer{Multihop: 256}, "out of range"},
		{"multihop ibgp", Peer{ASN: 65001, Multihop: 4}, "for an eBGP router only"},
		{"both passwords", Peer{Password: "a", PasswordFile: "/run/secrets/bgp"}, "password and passwordFile both given"},
		{"long password", Peer{Password: string(make([]byte, 81))}, "TCP MD5 keys are at most 80"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.peer
			p.Address = "10.0.0.1"
			if p.ASN == 0 {
				p.ASN = 65000
			}
			err := (&Config{ASN: 65001, Peers: []Peer{p}}).Validate()
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}
