package inspect_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
)

func TestCheckCleanStore(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", 0)
	n2 := startAgent(t, v.e, "n2", time.Minute)
	allocate(t, n1, 0, 20, false) // spills into a second block
	allocate(t, n2, 100, 3, true) // live reservations on their own lease
	allocate(t, n2, 200, 2, false)
	_, err := n1.Alloc.Release(t.Context(), owner(3))
	require.NoError(t, err)

	r := v.check(t)
	require.Empty(t, r.Findings, "a store written by agents only is clean")
	require.True(t, r.Clean())
	require.Positive(t, r.Scanned)
}

// baseline is a clean store: n1 holds 3 addresses, n2 holds 1.
type baseline struct {
	*env
	n1, n2 *agent
	al     records.Allocation // n1's first address
}

func newBaseline(t *testing.T) *baseline {
	v := newEnv(t)
	b := &baseline{env: v, n1: startAgent(t, v.e, "n1", 0), n2: startAgent(t, v.e, "n2", 0)}
	b.al = allocate(t, b.n1, 0, 3, false)[0]
	allocate(t, b.n2, 10, 1, false)
	require.Empty(t, v.check(t).Findings)
	return b
}

func TestCheckFindsPlantedFaults(t *testing.T) {
	for _, tc := range []struct {
		name string
		// plant breaks the store and returns the key a finding must name.
		plant func(t *testing.T, b *baseline) string
		want  []inspect.Kind
	}{{
		name: "same ip under another block key",
		plant: func(t *testing.T, b *baseline) string {
			// The address's /24 is no block of the pool, and has no claim:
			// the copy also sits in a block nobody can claim.
			key := etcdstore.IPsPrefix("small") + "10.20.0.0-24/" + b.al.Addr.String()
			b.put(t, key, b.al.Record)
			return key
		},
		want: []inspect.Kind{inspect.KindDuplicateIP, inspect.KindMisplaced, inspect.KindWrongNode, inspect.KindOrphanedBlock},
	}, {
		name: "same owner owns two ips",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.IPKey("small", b.al.Block, addrAt(t, b.al.Block, 14))
			b.put(t, key, b.al.Record)
			return key
		},
		want: []inspect.Kind{inspect.KindDuplicateOwner},
	}, {
		name: "allocation in another node's block",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.IPKey("small", b.al.Block, addrAt(t, b.al.Block, 13))
			b.put(t, key, record(owner(50), "n2", records.StateAllocated))
			return key
		},
		want: []inspect.Kind{inspect.KindWrongNode},
	}, {
		name: "orphaned block after the node's lease ended",
		plant: func(t *testing.T, b *baseline) string {
			b.n1.Kill(t)
			return etcdstore.HomeKey("small", b.al.Block)
		},
		want: []inspect.Kind{inspect.KindOrphanedBlock},
	}, {
		name: "claim of a node without node record",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.ClaimKey("small", freeBlock(t, b.snapshot(t)))
			b.put(t, key, records.Claim{Node: "ghost"}, clientv3.WithLease(b.lease(t)))
			return key
		},
		want: []inspect.Kind{inspect.KindDeadNodeClaim},
	}, {
		name: "claim without lease",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.ClaimKey("small", freeBlock(t, b.snapshot(t)))
			b.put(t, key, records.Claim{Node: "n1"})
			return key
		},
		want: []inspect.Kind{inspect.KindClaimWithoutLease},
	}, {
		name: "reservation without lease",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.IPKey("small", b.al.Block, addrAt(t, b.al.Block, 12))
			b.put(t, key, record(owner(51), "n1", records.StateReserved))
			return key
		},
		want: []inspect.Kind{inspect.KindExpiredReservation},
	}, {
		name: "confirmed allocation on a lease",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.IPKey("small", b.al.Block, addrAt(t, b.al.Block, 12))
			b.put(t, key, record(owner(52), "n1", records.StateAllocated), clientv3.WithLease(b.lease(t)))
			return key
		},
		want: []inspect.Kind{inspect.KindLeasedAllocation},
	}, {
		name: "records of a pool that does not exist",
		plant: func(t *testing.T, b *baseline) string {
			blk := netip.MustParsePrefix("10.9.0.0/28")
			b.put(t, etcdstore.ClaimKey("ghost", blk), records.Claim{Node: "n1"}, clientv3.WithLease(clientv3.LeaseID(b.n1.Session.ID())))
			key := etcdstore.IPKey("ghost", blk, netip.MustParseAddr("10.9.0.1"))
			b.put(t, key, record(owner(53), "n1", records.StateAllocated))
			return key
		},
		want: []inspect.Kind{inspect.KindUnknownPool},
	}, {
		name: "undecodable value",
		plant: func(t *testing.T, b *baseline) string {
			key := etcdstore.IPKey("small", b.al.Block, addrAt(t, b.al.Block, 11))
			b.put(t, key, "{not json")
			return key
		},
		want: []inspect.Kind{inspect.KindUndecodable},
	}, {
		name: "address outside its key's block",
		plant: func(t *testing.T, b *baseline) string {
			other := freeBlock(t, b.snapshot(t))
			key := etcdstore.BlockIPsPrefix("small", b.al.Block) + addrAt(t, other, 5).String()
			b.put(t, key, record(owner(54), "n1", records.StateAllocated))
			return key
		},
		want: []inspect.Kind{inspect.KindMisplaced},
	}, {
		name: "endpoint a node found lost when it came back",
		plant: func(t *testing.T, b *baseline) string {
			var taken inspect.IP // n2's address, which n1's pod used to have
			for _, ip := range b.snapshot(t).IPs {
				if ip.Node == "n2" {
					taken = ip
				}
			}
			rec := etcdstore.NodeRecord{Name: "n1", StartedAt: time.Now().UTC(), Lease: b.n1.Session.ID(),
				LostEndpoints: []etcdstore.LostEndpoint{{Owner: "old/eth0", Namespace: "default", Pod: "web-0", FoundAt: time.Now().UTC(),
					IPs: []etcdstore.LostIP{{IP: taken.Addr.String(), Pool: "small", HeldBy: taken.Owner.Key(), HeldByNode: "n2"}}}}}
			b.put(t, etcdstore.NodeKey("n1"), rec, clientv3.WithLease(clientv3.LeaseID(b.n1.Session.ID())))
			return taken.Key
		},
		want: []inspect.Kind{inspect.KindLostEndpoint},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBaseline(t)
			key := tc.plant(t, b)
			r := b.check(t)
			got := kinds(r)
			want := map[inspect.Kind]bool{}
			for _, k := range tc.want {
				want[k] = true
			}
			require.Equal(t, want, got, "findings: %+v", r.Findings)
			named := false
			for _, f := range r.Findings {
				require.NotEmpty(t, f.Message)
				for _, k := range f.Keys {
					named = named || k == key
				}
			}
			require.True(t, named, "a finding names %s: %+v", key, r.Findings)
		})
	}
}

// A reservation whose lease has run out cannot be produced in a real etcd
// (the lease deletes it), so this feeds CheckSnapshot the TTL etcd gives
// for a lease it no longer has.
func TestCheckExpiredReservationLease(t *testing.T) {
	v := newEnv(t)
	n1 := startAgent(t, v.e, "n1", time.Minute)
	res := allocate(t, n1, 0, 2, true)
	s := v.snapshot(t)
	var lease int64
	for _, ip := range s.IPs {
		lease = ip.Lease
	}
	require.NotZero(t, lease)

	require.Empty(t, inspect.CheckSnapshot(s, map[int64]int64{lease: 90}).Findings)
	r := inspect.CheckSnapshot(s, map[int64]int64{lease: -1})
	require.Len(t, r.Findings, len(res), "one finding per reservation on the lease")
	for _, f := range r.Findings {
		require.Equal(t, inspect.KindExpiredReservation, f.Kind)
		require.Contains(t, f.Message, "has expired")
	}
}

func TestCheckDuplicateIPv6Spelling(t *testing.T) {
	blk := netip.MustParsePrefix("fd00::/120")
	rec := record(owner(1), "n1", records.StateAllocated)
	s := &inspect.Snapshot{
		Pools:  map[string]inspect.Pool{"v6": {Pool: allocator.Pool{Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd00::/64")}, BlockSizeV6: 120}}},
		Nodes:  map[string]inspect.Node{"n1": {}},
		Claims: map[inspect.BlockKey]inspect.ClaimRec{{Pool: "v6", Block: blk}: {Claim: records.Claim{Node: "n1"}, Pool: "v6", Block: blk, Lease: 1}},
		Homes:  map[inspect.BlockKey]inspect.HomeRec{},
		IPs: []inspect.IP{
			{Record: rec, Pool: "v6", Block: blk, Addr: netip.MustParseAddr("fd00::5"), Key: etcdstore.IPKey("v6", blk, netip.MustParseAddr("fd00::5"))},
			{Record: rec, Pool: "v6", Block: blk, Addr: netip.MustParseAddr("fd00:0::5"), Key: etcdstore.BlockIPsPrefix("v6", blk) + "fd00:0::5"}, // the same address, spelled otherwise
		},
	}
	r := inspect.CheckSnapshot(s, nil)
	require.Equal(t, map[inspect.Kind]bool{inspect.KindDuplicateIP: true, inspect.KindMisplaced: true}, kinds(r), "%+v", r.Findings)
}
