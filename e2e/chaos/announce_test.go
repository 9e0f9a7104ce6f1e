package chaos

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// polls are a router's reads every 100 ms from at(0), announcers by
// prefix as each poll saw them (nil: the poll saw nothing).
func polls(seen ...map[netip.Prefix][]string) []RouterPoll {
	var out []RouterPoll
	for i, s := range seen {
		out = append(out, RouterPoll{At: at(100 * i), Announcers: s})
	}
	return out
}

// TestDoubleAnnouncedCatchesOverlap: a prefix two nodes announce in
// polls in a row is a finding when the run lasts the bound or longer;
// one node, or two nodes each announcing its own prefix, is not.
func TestDoubleAnnouncedCatchesOverlap(t *testing.T) {
	b1, b2 := netip.MustParsePrefix("10.0.0.0/30"), netip.MustParsePrefix("10.0.0.4/30")
	one := map[netip.Prefix][]string{b1: {"n1"}, b2: {"n2"}}
	two := map[netip.Prefix][]string{b1: {"n1", "n2"}, b2: {"n2"}}
	require.Empty(t, DoubleAnnounced(polls(one, one, one), 0))
	ps := polls(one, two, two, two, one)
	require.Empty(t, DoubleAnnounced(ps, time.Second), "200 ms is under the bound")
	fs := DoubleAnnounced(ps, 200*time.Millisecond)
	require.Len(t, fs, 1)
	require.Equal(t, "double-announced", fs[0].Kind)
	require.Equal(t, "10.0.0.0/30 was announced by [n1 n2] at once from 10:00:00.100 to 10:00:00.300 (at least 200ms; the bound is 200ms)", fs[0].Message)
	require.Len(t, DoubleAnnounced(polls(one, two, one), 0), 1, "with bound 0 one poll is enough")
	require.Len(t, DoubleAnnounced(polls(one, two), 0), 1, "a run open at the end counts")
	longest, runs := LongestDoubleAnnounced(polls(one, two, two, one, two, one))
	require.Equal(t, 100*time.Millisecond, longest)
	require.Equal(t, 2, runs)

	h := netip.MustParsePrefix("10.0.0.9/32")
	blocks, hosts := SplitHosts(polls(map[netip.Prefix][]string{b1: {"n1"}, h: {"n1", "n2"}}))
	require.Equal(t, map[netip.Prefix][]string{b1: {"n1"}}, blocks[0].Announcers)
	require.Equal(t, map[netip.Prefix][]string{h: {"n1", "n2"}}, hosts[0].Announcers)
}

// TestUnbackedCatchesAnnouncementWithoutClaim: an announcement is backed
// by the node's claim within the bound, a borrowed address's by its home
// and the node's record; a block announced long after its claim went, or
// by another node than the claimant, and a borrowed address announced
// after its node's record went, are findings.
func TestUnbackedCatchesAnnouncementWithoutClaim(t *testing.T) {
	b := netip.MustParsePrefix("10.0.0.0/30")
	h := netip.MustParsePrefix("10.0.0.9/32")
	backing := []Backing{
		{Kind: BackingNode, Node: "n1", Rev: 1, Seen: at(0)},
		{Kind: BackingClaim, Prefix: b, Node: "n1", Rev: 2, Seen: at(50)},
		{Kind: BackingLent, Prefix: h, Node: "n1", Rev: 3, Seen: at(60)},
		{Kind: BackingClaim, Prefix: b, Node: "n1", Rev: 4, Seen: at(250)}, // moved to a new lease
		{Kind: BackingClaim, Prefix: b, Deleted: true, Rev: 5, Seen: at(420)},
		{Kind: BackingNode, Node: "n1", Deleted: true, Rev: 6, Seen: at(430)},
	}
	up := map[netip.Prefix][]string{b: {"n1"}, h: {"n1"}}
	ps := polls(up, up, up, up, up)
	require.Empty(t, Unbacked(ps, backing, 100*time.Millisecond), "claimed from 50 ms, the poll at 0 within the bound")
	ps = polls(up, up, up, up, up, up, up, up)
	fs := Unbacked(ps, backing, 100*time.Millisecond)
	require.Len(t, fs, 2, "%v", fs)
	require.Equal(t, "10.0.0.0/30 announced by n1 from 10:00:00.600 to 10:00:00.700, with no claim of that node within 100ms", fs[0].Message)
	require.Equal(t, "10.0.0.9/32 announced by n1 from 10:00:00.600 to 10:00:00.700, with no claim of that node within 100ms", fs[1].Message)
	fs = Unbacked(polls(map[netip.Prefix][]string{b: {"n2"}}), backing, time.Second)
	require.Len(t, fs, 1, "another node than the claimant")
}
