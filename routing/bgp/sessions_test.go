package bgp

import (
	"bytes"
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
)

// startWith starts a speaker of asn peering with peer, logging at the
// default level (info) into the returned buffer, and syncs two prefixes.
func startWith(t *testing.T, asn ASN, peer Peer) (*Speaker, *syncbuf.Buffer) {
	t.Helper()
	var out syncbuf.Buffer
	log := hclog.New(&hclog.LoggerOptions{Output: &out, Level: hclog.Info})
	cfg := Config{ASN: asn, RestartTime: Duration{7 * time.Second}, Peers: []Peer{peer}}
	ctx := context.Background()
	s, err := Start(ctx, cfg, Options{Node: "n1", RouterID: netip.MustParseAddr("127.0.0.1"), Logger: log})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	nh := netip.MustParseAddr("10.254.1.11")
	require.NoError(t, s.Sync(ctx, []Route{{netip.MustParsePrefix("10.9.0.0/27"), nh}, {netip.MustParsePrefix("10.9.0.70/32"), nh}}))
	return s, &out
}

// awaitReason waits for the peer's reason in Status and returns it.
func awaitReason(t *testing.T, s *Speaker, class string) PeerStatus {
	t.Helper()
	var ps PeerStatus
	require.Eventually(t, func() bool {
		st := s.Status(context.Background())
		if len(st.Peers) != 1 {
			return false
		}
		ps = st.Peers[0]
		return ps.ReasonClass == class
	}, 30*time.Second, 50*time.Millisecond, "reason %q, not %q", class, ps.Reason)
	t.Logf("%s: %s", ps.State, ps.Reason)
	return ps
}

// TestBGPSessionReasonsWithoutRoot: against a GoBGP router on loopback,
// a refused connection, an OPEN the speaker refuses (the router's AS is
// not the configured one) and an OPEN the router refuses (the speaker's
// AS is not the one it expects) each give the peer a reason, in Status,
// in a warning at the default log level and in the down-reason metric;
// a peer that was never established shows nothing advertised.
func TestBGPSessionReasonsWithoutRoot(t *testing.T) {
	t.Run("refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := uint32(ln.Addr().(*net.TCPAddr).Port)
		require.NoError(t, ln.Close())
		s, out := startWith(t, 65001, Peer{Address: "127.0.0.1", ASN: 65000, Port: port})
		ps := awaitReason(t, s, "connect: refused")
		require.Contains(t, ps.Reason, "connection refused")
		require.False(t, ps.ReasonSince.IsZero())
		require.Equal(t, map[string]uint64{"ipv4": 0, "ipv6": 0}, ps.Advertised, "nothing was sent to a peer never connected")
		require.Contains(t, out.String(), "[WARN]  bgp session not established: peer=127.0.0.1 reason=\"cannot connect:")

		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(s.Collector())
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP kvipam_bgp_peer_down_reason 1 for why the BGP session with the peer is not established: the connect error's kind or the NOTIFICATION sent or received (code / subcode); absent while it is.
# TYPE kvipam_bgp_peer_down_reason gauge
kvipam_bgp_peer_down_reason{peer="127.0.0.1",reason="connect: refused"} 1
`), "kvipam_bgp_peer_down_reason"))
	})
	t.Run("router's AS not the configured one", func(t *testing.T) {
		_, port := router(t) // AS 65000
		s, out := startWith(t, 65001, Peer{Address: "127.0.0.1", ASN: 65099, Port: port})
		ps := awaitReason(t, s, "notification sent: OPEN Message Error / Bad Peer AS")
		require.Contains(t, ps.Reason, "sent NOTIFICATION OPEN Message Error / Bad Peer AS")
		require.Contains(t, ps.Reason, "65099")
		require.Contains(t, out.String(), "OPEN Message Error / Bad Peer AS")
	})
	t.Run("this node's AS not the one the router expects", func(t *testing.T) {
		_, port := router(t) // expects AS 65001
		s, out := startWith(t, 65002, Peer{Address: "127.0.0.1", ASN: 65000, Port: port})
		ps := awaitReason(t, s, "notification received: OPEN Message Error / Bad Peer AS")
		require.Contains(t, ps.Reason, "the router expects another AS of this node than bgp.asn 65002")
		require.Contains(t, ps.Reason, "probe connection")
		require.Contains(t, out.String(), "bgp session not established")
		require.Equal(t, 1, strings.Count(out.String(), "bgp session not established"), "one warning, the probe's: %s", out)
	})
}

// TestBGPSessionReasonRateLimited: a reason that does not change is
// warned of once, and again only after warnEvery; a new one at once;
// an established session clears it and says so.
func TestBGPSessionReasonRateLimited(t *testing.T) {
	var out bytes.Buffer
	s := newSessions(hclog.New(&hclog.LoggerOptions{Output: &out, Level: hclog.Info}), nil)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s.now = func() time.Time { return now }
	refused := DownReason{Class: "connect: refused", Detail: "cannot connect: refused"}
	for range 5 {
		s.set("10.0.0.1", refused)
		now = now.Add(5 * time.Second)
	}
	require.Equal(t, 1, strings.Count(out.String(), "[WARN]"), out.String())
	now = now.Add(warnEvery)
	s.set("10.0.0.1", refused)
	require.Equal(t, 2, strings.Count(out.String(), "[WARN]"))
	require.Contains(t, out.String(), "still not established")
	r, ok := s.reason("10.0.0.1")
	require.True(t, ok)
	require.Equal(t, time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), r.Since, "since the reason first appeared")

	s.set("10.0.0.1", DownReason{Class: "connect: timeout", Detail: "cannot connect: timeout"})
	require.Equal(t, 3, strings.Count(out.String(), "[WARN]"), "a new reason at once")
	s.stateChanged("10.0.0.1", "BGP_FSM_OPENCONFIRM", "BGP_FSM_ESTABLISHED", "open-msg-negotiated")
	_, ok = s.reason("10.0.0.1")
	require.False(t, ok)
	require.Contains(t, out.String(), "bgp session established")
}
