package e2e

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestBGPPasswordFromFile: a node's TCP MD5 password is read from a file
// (peers[].passwordFile, as a Kubernetes Secret mounted into the agent
// container gives it, with a trailing newline), not the configuration:
// FRR, which requires that password of the node, establishes the session
// and has the node's block.
func TestBGPPasswordFromFile(t *testing.T) {
	f := newBGPFabric(t, []bgpNodeSpec{{name: "m1", rack: "A", host: 11, password: "s3cret-from-file", passwordFile: true}})
	m1 := f.nodes[0]
	m1.addPod(t, "m1-p0")
	f.waitTables(t)
	st := m1.n.status()
	require.NotNil(t, st.BGP)
	require.Len(t, st.BGP.Peers, 1)
	require.Equal(t, "established", st.BGP.Peers[0].State)
	out, err := f.frr.vtysh("show bgp neighbors " + m1.v4.String())
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "Peer Authentication Enabled", "FRR checks the session's TCP MD5 signatures")
	require.NoError(t, m1.n.del(m1.l, m1.pods[0]))
}

// TestBGPSessionFailureReasonShown: sessions with FRR that cannot come up
// say why, at the agent's default log level (a warning, not repeated
// every connect attempt), in `kvipamctl agent status` and in the metric
// kvipam_bgp_peer_down_reason, each by its cause:
//   - an AS mismatch the agent finds: x1 expects AS 65099 of the router,
//     which is 65000: x1 sends OPEN Message Error / Bad Peer AS;
//   - an AS mismatch the router finds: y1 is AS 65002, FRR expects 65001
//     of it and refuses its OPEN with OPEN Message Error / Bad Peer AS
//     (which GoBGP does not decode at that stage: the agent reads it on a
//     probe connection);
//   - an unreachable peer: x1 also peers with 10.254.9.1, which the
//     router has no route to;
//   - a wrong MD5 password: FRR drops z1's segments, signed with another
//     password, so the connection times out.
//
// Nothing is counted as advertised to a peer whose session never came
// up, though the node announces its block.
func TestBGPSessionFailureReasonShown(t *testing.T) {
	const unreachable = "10.254.9.1"
	f := newBGPFabric(t, []bgpNodeSpec{
		{name: "x1", rack: "A", host: 11, down: true, logLevel: "info", metrics: "127.0.0.1:9464", peers: []map[string]any{
			{"address": "10.254.1.1", "asn": 65099, "holdTime": "9s"},
			{"address": unreachable, "asn": 65000, "holdTime": "9s"},
		}},
		{name: "y1", rack: "A", host: 12, down: true, logLevel: "info", asn: 65002},
		{name: "z1", rack: "B", host: 13, down: true, logLevel: "info", password: "s3cret", agentPassword: "not-the-one"},
	})
	x1, y1, z1 := f.nodes[0], f.nodes[1], f.nodes[2]
	x1.addPod(t, "x1-p0")

	// reason waits for the reason of n's session with peer to be of class.
	reason := func(b *bgpNode, peer, class string) string {
		t.Helper()
		var got string
		waitFor(t, 60*time.Second, b.n.name+"'s session with "+peer+" to say "+class, func() bool {
			for _, p := range b.n.status().BGP.Peers {
				if p.Address == peer {
					got = p.Reason
					return p.ReasonClass == class
				}
			}
			return false
		})
		t.Logf("%s, peer %s: %s", b.n.name, peer, got)
		return got
	}
	require.Contains(t, reason(x1, "10.254.1.1", "notification sent: OPEN Message Error / Bad Peer AS"), "expected 65099, received 65000")
	require.Contains(t, reason(y1, "10.254.1.1", "notification received: OPEN Message Error / Bad Peer AS"), "the router expects another AS of this node than bgp.asn 65002")
	reason(x1, unreachable, "connect: unreachable")
	require.Contains(t, reason(z1, "10.254.2.1", "connect: timeout"), "TCP MD5 password")
	for _, b := range f.nodes {
		require.False(t, f.frr.established(b.v4), "%s's session did not come up", b.n.name)
	}
	t.Logf("FRR on y1: %q", f.frr.neighbor(y1.v4).ResetDueTo)

	// The status table: the reason beside the state; nothing advertised.
	ctl, err := exec.Command(x1.n.bin+"/kvipamctl", "agent", "status", "--socket", x1.n.socket).CombinedOutput()
	require.NoError(t, err, "%s", ctl)
	t.Logf("kvipamctl agent status on x1:\n%s", ctl)
	require.Contains(t, string(ctl), "REASON")
	require.Contains(t, string(ctl), "sent NOTIFICATION OPEN Message Error / Bad Peer AS")
	st := x1.n.status()
	require.Equal(t, 1, st.BGP.Announced["ipv4"], "x1 announces its block")
	for _, p := range st.BGP.Peers {
		require.Equal(t, map[string]uint64{"ipv4": 0, "ipv6": 0}, p.Advertised, "nothing sent to %s, never established", p.Address)
	}

	metrics := scrape(t, x1.n, "127.0.0.1:9464")
	require.Contains(t, metrics, `kvipam_bgp_peer_down_reason{peer="10.254.1.1",reason="notification sent: OPEN Message Error / Bad Peer AS"} 1`)
	require.Contains(t, metrics, `kvipam_bgp_peer_down_reason{peer="`+unreachable+`",reason="connect: unreachable"} 1`)

	// The log at the default level: a warning per peer and reason, not one
	// per attempt: GoBGP tries again every 5-10 s, and 15 s have passed
	// since x1's first.
	waitFor(t, 30*time.Second, "15 s of x1's failing attempts", func() bool {
		for _, p := range x1.n.status().BGP.Peers {
			if p.Address == "10.254.1.1" {
				return time.Since(p.ReasonSince) > 15*time.Second
			}
		}
		return false
	})
	for _, c := range []struct {
		b            *bgpNode
		peer, reason string
	}{{x1, "10.254.1.1", "Bad Peer AS"}, {x1, unreachable, "cannot connect"}, {y1, "10.254.1.1", "Bad Peer AS"}, {z1, "10.254.2.1", "cannot connect"}} {
		var warns []string
		log := readLog(t, c.b.n)
		for _, l := range strings.Split(log, "\n") {
			var e map[string]any
			if json.Unmarshal([]byte(l), &e) != nil || e["@level"] != "warn" || e["@message"] != "bgp session not established" || e["peer"] != c.peer {
				continue
			}
			reason, _ := e["reason"].(string)
			warns = append(warns, reason)
		}
		require.Len(t, warns, 1, "%s: one warning for %s's reason:\n%s", c.b.n.name, c.peer, log)
		require.Contains(t, warns[0], c.reason, "%s's warning for %s", c.b.n.name, c.peer)
	}
	require.NoError(t, x1.n.del(x1.l, x1.pods[0]))
}
