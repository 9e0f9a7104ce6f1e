package inspect_test

import (
	"encoding/json"
	"math/big"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
)

func TestAddressCount(t *testing.T) {
	two64 := new(big.Int).Lsh(big.NewInt(1), 64)
	for _, tc := range []struct {
		name string
		pool allocator.Pool
		want []string // per family, ascending
	}{
		{"v4 /24 in /28 blocks less network and broadcast", small, []string{"254"}},
		{"v4 /31 uses every address", allocator.Pool{Name: "p2p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/31")}, BlockSizeV4: 32}, []string{"2"}},
		{"two v4 cidrs", allocator.Pool{Name: "two", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.1.0.0/26")}, BlockSizeV4: 26}, []string{"316"}},
		{"v6 /64 beyond uint64, less the anycast address",
			allocator.Pool{Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd00::/64")}, BlockSizeV6: 120},
			[]string{new(big.Int).Sub(two64, big.NewInt(1)).String()}},
		{"dual stack", allocator.Pool{Name: "dual", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/30"), netip.MustParsePrefix("fd00::/126")}, BlockSizeV4: 32, BlockSizeV6: 128},
			[]string{"2", "3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, tc.pool.Validate())
			s := &inspect.Snapshot{Pools: map[string]inspect.Pool{tc.pool.Name: {Pool: tc.pool}}}
			u := inspect.Usage(s, "")
			require.Len(t, u, len(tc.want))
			for i, w := range tc.want {
				require.Equal(t, w, u[i].Addresses.String())
				require.Equal(t, w, u[i].Free.String(), "nothing allocated")
				require.Equal(t, tc.pool.BlockCount(allocator.FamilyOf(u[i].CIDRs[0].Addr())), u[i].FreeBlocks)
			}
		})
	}
}

func TestUsageBlocksAndIPs(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	n2 := startAgent(t, v.e, "n2", time.Minute)
	allocate(t, n1, 0, 20, false)
	allocate(t, n2, 100, 5, true)

	u := inspect.Usage(v.snapshot(t), "small")
	require.Len(t, u, 1)
	require.Equal(t, inspect.PoolUsage{
		Pool: "small", Family: "ipv4", CIDRs: small.CIDRs, BlockSize: 28,
		Addresses: big.NewInt(254), Blocks: 16, Claimed: 3, FreeBlocks: 13,
		Allocated: 20, Reserved: 5, Free: big.NewInt(229), Holders: map[string]int{"n1": 20, "n2": 5},
	}, u[0])
	js, err := json.Marshal(u[0])
	require.NoError(t, err)
	require.Contains(t, string(js), `"addresses":254`, "big counts are plain JSON numbers")

	n1.Kill(t)
	s := v.snapshot(t)
	u = inspect.Usage(s, "")
	require.Equal(t, 1, u[0].Claimed)
	require.Equal(t, 2, u[0].Orphaned, "n1's blocks hold addresses: orphaned, not free")
	require.Equal(t, uint64(13), u[0].FreeBlocks)

	used := 0
	for _, r := range inspect.Blocks(s, "small") {
		switch r.Node {
		case "n1":
			require.Equal(t, inspect.BlockOrphaned, r.State)
			require.Zero(t, r.ClaimLease)
			used += r.Used
		case "n2":
			require.Equal(t, inspect.BlockClaimed, r.State)
			require.Equal(t, 5, r.Reserved)
			require.Equal(t, n2.Session.ID(), r.ClaimLease)
		default:
			t.Fatalf("unexpected block %+v", r)
		}
		require.LessOrEqual(t, r.Capacity, 16)
		require.GreaterOrEqual(t, r.Capacity, 15)
	}
	require.Equal(t, 20, used)
	require.Empty(t, inspect.Blocks(s, "other"))

	for _, tc := range []struct {
		name string
		f    inspect.IPFilter
		want int
	}{
		{"all", inspect.IPFilter{}, 25},
		{"pool", inspect.IPFilter{Pool: "small"}, 25},
		{"other pool", inspect.IPFilter{Pool: "other"}, 0},
		{"node", inspect.IPFilter{Node: "n2"}, 5},
		{"owner", inspect.IPFilter{Owner: owner(7).ContainerID}, 1},
		{"reserved", inspect.IPFilter{State: records.StateReserved}, 5},
		{"allocated on n1", inspect.IPFilter{Node: "n1", State: records.StateAllocated}, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := inspect.IPs(s, tc.f)
			require.NoError(t, err)
			require.Len(t, got, tc.want)
			for _, ip := range got {
				require.True(t, tc.f.Match(ip))
			}
		})
	}
	_, err = inspect.IPs(s, inspect.IPFilter{State: "gone"})
	require.ErrorIs(t, err, inspect.ErrBadFilter)

	nodes := inspect.Nodes(s)
	require.Equal(t, []inspect.NodeRow{
		{Node: "n1", Alive: false, Claims: 0, Homes: 2, IPs: 20},
		{Node: "n2", Alive: true, Claims: 1, Homes: 1, IPs: 5},
	}, nodes)
}

func TestSnapshotPagesAndProgress(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	allocate(t, n1, 0, 30, false)
	whole := v.snapshot(t)

	var reports []int
	in := inspect.New(v.cli, inspect.Options{PageSize: 7, ProgressEvery: 10, Progress: func(n int) { reports = append(reports, n) }})
	paged, err := in.Snapshot(t.Context())
	require.NoError(t, err)
	require.Equal(t, whole.IPs, paged.IPs, "pages read the same keys")
	require.Equal(t, whole.Scanned, paged.Scanned)
	require.Equal(t, whole.Revision, paged.Revision)
	require.Len(t, reports, whole.Scanned/10)
	for i, n := range reports {
		require.Equal(t, 10*(i+1), n)
	}
}
