package main

import (
	"math/big"
	"os"
	"os/user"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// tableRows reads a table's output into one map per row, keyed by the
// header's column names.
func tableRows(t testing.TB, out string) []map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	head := strings.Fields(lines[0])
	var rows []map[string]string
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		require.Len(t, f, len(head), "row %q of\n%s", l, out)
		r := map[string]string{}
		for i, h := range head {
			r[h] = f[i]
		}
		rows = append(rows, r)
	}
	return rows
}

// showValue is the values of pool show's rows labelled label
// ("  pending  2  reservations of unfinished ADDs" gives "2").
func showValue(t testing.TB, out, label string) []string {
	t.Helper()
	var vals []string
	for _, l := range strings.Split(out, "\n") {
		// tabwriter pads a cell with two spaces or more: "  free" is not
		// "  free blocks".
		if rest, ok := strings.CutPrefix(l, "  "+label+"  "); ok {
			vals = append(vals, strings.Fields(rest)[0])
		}
	}
	require.NotEmpty(t, vals, "no %q row in\n%s", label, out)
	return vals
}

// pool list says whether a pool is disabled, its columns use pool show's
// words for the same counts (pending: reservations of unfinished ADDs;
// reserved: ranges an operator reserved), and IPv6 sizes read as powers
// of two.
func TestPoolListColumns(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	h.ok("pool", "create", "dual", "--cidr", "10.30.0.0/16", "--cidr", "fd00:30::/64")
	h.ok("pool", "reserve", "small", "10.20.0.1-10.20.0.9")
	n1 := agenttest.Start(t, h.e, "n1", agenttest.Options{Pools: []string{"dual", "small"}})
	n1.Allocate(t, "small", 0, 3, false)
	n1.Allocate(t, "small", 10, 2, true) // unfinished ADDs
	h.ok("pool", "disable", "small")

	rows := tableRows(t, h.ok("pool", "list"))
	require.Len(t, rows, 3)
	byKey := map[string]map[string]string{}
	for _, r := range rows {
		byKey[r["NAME"]+"/"+r["FAMILY"]] = r
	}
	small := byKey["small/ipv4"]
	require.Equal(t, "disabled", small["STATE"])
	require.Equal(t, "enabled", byKey["dual/ipv4"]["STATE"])
	require.Equal(t, "3", small["ALLOCATED"])
	require.Equal(t, "2", small["PENDING"])
	require.Equal(t, "9", small["RESERVED"])
	require.Equal(t, "2^64-1", byKey["dual/ipv6"]["ADDRESSES"], "a /64 less its anycast address")
	require.Equal(t, "2^64-1", byKey["dual/ipv6"]["FREE"])
	require.Equal(t, "2^56", byKey["dual/ipv6"]["BLOCKS"], "a /64 in /120 blocks")
	require.Equal(t, "65534", byKey["dual/ipv4"]["ADDRESSES"])

	show := h.ok("pool", "show", "small")
	require.Equal(t, []string{small["PENDING"]}, showValue(t, show, "pending"), "the same word, the same count")
	require.Equal(t, []string{small["RESERVED"]}, showValue(t, show, "reserved"))
	require.Equal(t, []string{small["FREE"]}, showValue(t, show, "free"))
	show = h.ok("pool", "show", "dual")
	require.Contains(t, showValue(t, show, "addresses"), "2^64-1")
}

func TestAddressCount(t *testing.T) {
	pow := func(k uint) *big.Int { return new(big.Int).Lsh(big.NewInt(1), k) }
	add := func(a *big.Int, d int64) *big.Int { return new(big.Int).Add(a, big.NewInt(d)) }
	for _, tc := range []struct {
		n    *big.Int
		want string
	}{
		{big.NewInt(0), "0"},
		{big.NewInt(254), "254"},
		{add(pow(32), -1), "4294967295"},
		{pow(32), "2^32"},
		{pow(64), "2^64"},
		{add(pow(64), -1), "2^64-1"},
		{add(pow(64), -300), "2^64-300"},
		{add(pow(65), 7), "2^65+7"},
		{new(big.Int).Mul(big.NewInt(3), pow(64)), "3*2^64"},
		{add(new(big.Int).Mul(big.NewInt(3), pow(64)), -2), "3*2^64-2"},
	} {
		require.Equal(t, tc.want, addressCount(tc.n), tc.n.String())
	}
	require.Equal(t, "-", addressCount(nil))
}

// Audit lines name the operator when $USER is unset: the login name of
// the uid, else uid=N.
func TestAuditOperatorWithoutUSER(t *testing.T) {
	h := newHarness(t)
	delete(h.env, "USER")
	h.withSmallPool()
	n1 := h.agent("n1")
	held := n1.Allocate(t, "small", 0, 1, false)
	n1.Kill(t)
	code, _, errs := h.run("release", "--ip", held[0].Addr.String(), "--confirm-gone", "n1", "--last-seen", "0s")
	require.Equal(t, exitOK, code, errs)
	want := "uid=" + strconv.Itoa(os.Getuid())
	if u, err := user.Current(); err == nil && u.Username != "" {
		want = u.Username
	}
	require.Contains(t, errs, "operator="+want)
}
