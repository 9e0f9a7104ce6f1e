package agent

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/syncbuf"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestAgentRefusesSpecialRangePool: a pool in etcd overlapping a special
// range (written raw, as before such ranges were refused) is refused by
// the agent, at start and when it appears later: an ERROR line and its
// status name the range and why, an ADD that asks for it fails with that
// reason, and the agent goes on serving its other pools. A seed pool of
// the configuration that overlaps one is a configuration error.
func TestAgentRefusesSpecialRangePool(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	putPool := func(p allocator.Pool) {
		t.Helper()
		b, err := json.Marshal(p)
		require.NoError(t, err)
		_, err = cli.Put(ctx, etcdstore.PoolKey(p.Name), string(b))
		require.NoError(t, err)
	}
	putPool(allocator.Pool{Name: "legacy", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("169.254.0.0/24")}})

	cfg := testConfig(t, e)
	var logs syncbuf.Buffer
	ta := startAgent(t, cfg, Options{Logger: hclog.New(&hclog.LoggerOptions{Output: &logs, Level: hclog.Info})})

	_, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true, Pool: "legacy"})
	require.ErrorContains(t, err, "pool legacy is refused")
	require.ErrorContains(t, err, "169.254.1.1")
	res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(2), Permanent: true})
	require.NoError(t, err, "the valid pool is served")
	require.Equal(t, testPool.Name, res.Pool)
	require.Contains(t, logs.String(), "[ERROR]")
	require.Contains(t, logs.String(), "cidr 169.254.0.0/24 overlaps 169.254.0.0/16")
	require.Equal(t, "169.254.0.0/24 overlaps", refusedIn(t, ta, "legacy"))

	// Written while the agent runs: refused the same way.
	putPool(allocator.Pool{Name: "lo", BlockSizeV6: 128, CIDRs: []netip.Prefix{netip.MustParsePrefix("::1/128")}})
	require.Eventually(t, func() bool { return refusedIn(t, ta, "lo") != "" }, 10*time.Second, 20*time.Millisecond)
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(3), Permanent: true, Pool: "lo"})
	require.ErrorContains(t, err, "overlaps ::1/128, IPv6 loopback")

	// A seed pool overlapping one: the configuration is refused.
	bad := testConfig(t, e)
	bad.Node = "node-2"
	bad.Pools = []allocator.Pool{{Name: "mc", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("224.0.0.0/24")}}}
	bad.DefaultPool = "mc"
	_, err = New(bad, Options{})
	require.ErrorContains(t, err, "invalid configuration")
	require.ErrorContains(t, err, "cidr 224.0.0.0/24 overlaps 224.0.0.0/4, IPv4 multicast")
}

// refusedIn is the start of why the agent's status says pool is
// refused ("" when it is not), its cidr and "overlaps".
func refusedIn(t testing.TB, ta *testAgent, pool string) string {
	t.Helper()
	st, err := ta.c.Status(context.Background())
	require.NoError(t, err)
	for _, p := range st.Pools {
		if p.Pool == pool && p.Refused != "" {
			_, after, _ := strings.Cut(p.Refused, "cidr ")
			f := strings.Fields(after)
			if len(f) < 2 {
				return p.Refused
			}
			return f[0] + " " + f[1]
		}
	}
	return ""
}
