package memstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/records/memstore"
)

// An operator's pool commands: a change lands whole; a cidr or a pool
// that holds anything is refused; a deleted pool is marked, and no seed
// makes it again until an operator creates it.
func TestAdminPools(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	extra := netip.MustParsePrefix("10.0.1.0/28")
	p, err := s.UpdatePool("p", func(p *allocator.Pool) error { p.CIDRs = append(p.CIDRs, extra); return nil })
	require.NoError(t, err)
	require.Contains(t, p.CIDRs, extra)
	_, err = s.UpdatePool("p", func(p *allocator.Pool) error { p.CIDRs = p.CIDRs[:1]; return nil })
	require.Error(t, err, "CheckPoolUpdate: no cidr removed by an update")

	lease := s.Grant(30 * time.Second)
	_, err = s.Claim(ctx, "p", extra, records.Claim{Node: "n1"}, lease)
	require.NoError(t, err)
	_, err = s.RemoveCIDR("p", extra)
	require.ErrorIs(t, err, memstore.ErrPoolInUse)
	s.Revoke(lease)
	_, err = s.RemoveCIDR("p", extra)
	require.ErrorIs(t, err, memstore.ErrPoolInUse, "the block's home stays")

	q := allocator.Pool{Name: "q", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24")}}
	_, err = s.EnsurePool(ctx, q)
	require.NoError(t, err)
	require.NoError(t, s.DeletePool("q"))
	require.True(t, s.PoolDeleted("q"))
	_, created, err := s.SeedPool(ctx, q)
	require.ErrorIs(t, err, memstore.ErrPoolDeleted)
	require.False(t, created)
	_, err = s.EnsurePool(ctx, q)
	require.NoError(t, err, "an operator creates it again")
	require.False(t, s.PoolDeleted("q"))
}

// An operator's release of an owner and removal of a node that is gone:
// the owner's records and the binding naming it go; the node's blocks
// are freed, but for an address another node borrowed, whose home stays.
func TestAdminReleaseAndRemoveNode(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	l1, l2 := s.Grant(30*time.Second), s.Grant(30*time.Second)
	res, err := s.Claim(ctx, "p", block, records.Claim{Node: "n1"}, l1)
	require.NoError(t, err)
	o1 := records.Owner{ContainerID: "c1", IfName: "eth0"}
	o2 := records.Owner{ContainerID: "c2", IfName: "eth0"}
	a2, a3 := netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.0.0.3")
	_, err = s.WriteBound(ctx, records.Binding{Pool: "p", Identity: "ns/web", Owner: o1, Node: "n1", Addrs: []netip.Addr{a1}},
		[]records.IPWrite{{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a1, Record: records.Record{Owner: o1, Node: "n1", State: records.StateAllocated, Identity: "ns/web"}}})
	require.NoError(t, err)
	_, err = s.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a2, Record: records.Record{Owner: o2, Node: "n1", State: records.StateAllocated}}})
	require.NoError(t, err)
	fence, err := s.FenceBorrower(ctx, records.Claim{Node: "n2"}, l2)
	require.NoError(t, err)
	_, err = s.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: block, ClaimRev: fence, Addr: a3, Borrowed: true, Record: records.Record{Owner: records.Owner{ContainerID: "c3", IfName: "eth0"}, Node: "n2", State: records.StateAllocated, Borrowed: true}}})
	require.NoError(t, err)

	require.Equal(t, 1, s.ReleaseOwner(o1, "n1"))
	bs, err := s.ListBindings(ctx, "p")
	require.NoError(t, err)
	require.Empty(t, bs, "the binding naming the released owner goes")

	s.Revoke(l1)
	s.RemoveNode("n1")
	var left []netip.Addr
	for _, al := range s.PoolIPs("p") {
		left = append(left, al.Addr)
	}
	require.Equal(t, []netip.Addr{a3}, left, "only the address n2 borrowed stays")
	blocks, err := s.ListBlocks(ctx, "p")
	require.NoError(t, err)
	require.Len(t, blocks, 1)
	require.Nil(t, blocks[0].Claim)
	require.Equal(t, "n1", blocks[0].Home.Node, "the home stays while a borrowed address is in the block")
	require.Equal(t, "n2", s.LentAt("p")[a3].Node)

	s.Lose("p", a3)
	require.Empty(t, s.PoolIPs("p"))
	require.Empty(t, s.LentAt("p"))
}
