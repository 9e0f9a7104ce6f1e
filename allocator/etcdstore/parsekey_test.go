package etcdstore_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// TestParseKeyReadsWhatTheBuildersWrite: every key builder's key parses
// back into the names it was built from, and malformed keys say what was
// expected while keeping what parsed.
func TestParseKeyReadsWhatTheBuildersWrite(t *testing.T) {
	b := netip.MustParsePrefix("10.0.0.16/28")
	a := netip.MustParseAddr("10.0.0.20")
	v6 := netip.MustParsePrefix("fd00::100/120")
	for _, tc := range []struct {
		key  string
		want etcdstore.Key
	}{
		{etcdstore.PoolKey("p"), etcdstore.Key{Kind: etcdstore.KeyPool, Pool: "p"}},
		{etcdstore.DeletedPoolKey("p"), etcdstore.Key{Kind: etcdstore.KeyDeletedPool, Pool: "p"}},
		{etcdstore.NodeKey("n1"), etcdstore.Key{Kind: etcdstore.KeyNode, Node: "n1"}},
		{etcdstore.ClaimKey("p", b), etcdstore.Key{Kind: etcdstore.KeyClaim, Pool: "p", Block: b}},
		{etcdstore.HomeKey("p", v6), etcdstore.Key{Kind: etcdstore.KeyHome, Pool: "p", Block: v6}},
		{etcdstore.LentKey("p", a), etcdstore.Key{Kind: etcdstore.KeyLent, Pool: "p", Addr: a}},
		{etcdstore.IPKey("p", b, a), etcdstore.Key{Kind: etcdstore.KeyIP, Pool: "p", Block: b, Addr: a}},
		{etcdstore.BindingKey("p", "ns/web-0"), etcdstore.Key{Kind: etcdstore.KeyBinding, Pool: "p", Identity: "ns/web-0"}},
	} {
		t.Run(tc.key, func(t *testing.T) {
			got, err := etcdstore.ParseKey(tc.key)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}

	for _, tc := range []struct {
		name, key string
		want      etcdstore.Key
		err       string
	}{
		{"nested pool", etcdstore.PoolKey("p") + "/x", etcdstore.Key{Kind: etcdstore.KeyPool}, "want " + etcdstore.PoolsPrefix() + "<pool>"},
		{"claim of no block", etcdstore.ClaimsPrefix("p") + "not-a-block", etcdstore.Key{Kind: etcdstore.KeyClaim, Pool: "p"}, "not-a-block"},
		{"lent address garbage", etcdstore.LentPrefix("p") + "nope", etcdstore.Key{Kind: etcdstore.KeyLent, Pool: "p"}, "lent address"},
		{"allocation of no address", etcdstore.BlockIPsPrefix("p", b) + "garbage", etcdstore.Key{Kind: etcdstore.KeyIP, Pool: "p", Block: b}, "parse address"},
		{"allocation too short", etcdstore.IPsPrefix("p") + "x", etcdstore.Key{Kind: etcdstore.KeyIP}, "<pool>/<block>/<ip>"},
		{"binding without namespace", etcdstore.StickyPrefix("p") + "web-0", etcdstore.Key{Kind: etcdstore.KeyBinding}, "<namespace>/<name>"},
		{"not a record", etcdstore.HealthKey(), etcdstore.Key{}, "not a record"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := etcdstore.ParseKey(tc.key)
			require.ErrorContains(t, err, tc.err)
			require.Equal(t, tc.want, got)
		})
	}
	// Lenient on purpose: an address outside its key's block is read as
	// written (it still keeps that block from being empty).
	out := netip.MustParseAddr("10.0.0.99")
	got, err := etcdstore.ParseKey(etcdstore.IPKey("p", b, out))
	require.NoError(t, err)
	require.Equal(t, etcdstore.Key{Kind: etcdstore.KeyIP, Pool: "p", Block: b, Addr: out}, got)
}
