package memstore_test

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

var (
	block = netip.MustParsePrefix("10.0.0.0/28")
	a1    = netip.MustParseAddr("10.0.0.1")
)

func newStore(t testing.TB) *memstore.Store {
	t.Helper()
	s := memstore.New(memstore.Options{})
	_, err := s.EnsurePool(context.Background(), allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	return s
}

func rec(state records.State) records.Record {
	return records.Record{Owner: records.Owner{ContainerID: "c1", IfName: "eth0"}, Node: "n1", State: state}
}

// The clock is the only time there is: a lease ends exactly when Advance
// reaches its TTL, and a keep-alive renews it.
func TestLeasesFollowTheClock(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	lease := s.Grant(10 * time.Second)
	res, err := s.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	require.NoError(t, err)
	s.Advance(9 * time.Second)
	require.True(t, s.KeepAlive(lease))
	s.Advance(9 * time.Second)
	exp, err := s.LeaseExpiry(ctx, lease)
	require.NoError(t, err)
	require.Equal(t, s.Now().Add(time.Second), exp)
	blocks, err := s.ListBlocks(ctx, "p")
	require.NoError(t, err)
	require.True(t, blocks[0].Owned("n1"))
	rev := s.Rev()
	s.Advance(time.Second)
	blocks, err = s.ListBlocks(ctx, "p")
	require.NoError(t, err)
	require.Nil(t, blocks[0].Claim, "the claim ended with its lease")
	require.Equal(t, "n1", blocks[0].Home.Node)
	require.Equal(t, rev+1, s.Rev())
	require.False(t, s.KeepAlive(lease))
	_, err = s.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a1, Record: rec(records.StateAllocated)}})
	var we *records.WriteError
	require.ErrorAs(t, err, &we)
}

// A reservation lives its TTL plus the lease's sharing window, then
// lapses by itself.
func TestReservationLapses(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{ReservationTTL: 40 * time.Second})
	_, err := s.EnsurePool(ctx, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28})
	require.NoError(t, err)
	first := records.IPWrite{Pool: "p", Block: block, Addr: a1, Record: rec(records.StateReserved), Reserve: true}
	res, err := s.Claim(ctx, "p", block, records.Claim{Node: "n1", First: &first}, s.Grant(time.Hour))
	require.NoError(t, err)
	require.Equal(t, s.Now().Add(50*time.Second), res.Expires)
	refs := []records.IPRef{{Pool: "p", Block: block, Addr: a1}}
	s.Advance(49 * time.Second)
	got, err := s.GetIPs(ctx, refs)
	require.NoError(t, err)
	require.Contains(t, got, a1)
	s.Advance(time.Second)
	got, err = s.GetIPs(ctx, refs)
	require.NoError(t, err)
	require.Empty(t, got)
	done, err := s.RecordLapsed(ctx, records.Allocation{Record: rec(records.StateReserved), Pool: "p", Block: block, Addr: a1, Rev: res.Rev}, s.Now())
	require.NoError(t, err)
	require.True(t, done)
	last, err := s.LastReleased(ctx, "p", []netip.Addr{a1})
	require.NoError(t, err)
	require.Equal(t, s.Now(), last[a1])
	// History is kept for its retention past the end of its hour.
	s.Advance(7*24*time.Hour + time.Hour)
	last, err = s.LastReleased(ctx, "p", []netip.Addr{a1})
	require.NoError(t, err)
	require.Empty(t, last)
}

// A fault plan decides each call: refused and lost calls apply nothing,
// an unknown outcome applies and reports failure.
func TestFaults(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	lease := s.Grant(time.Minute)
	var next memstore.Fault
	var seen []memstore.Call
	fs := memstore.WithFaults(s, func(c memstore.Call) memstore.Fault {
		seen = append(seen, c)
		return next
	})
	claims := func() int {
		blocks, err := s.ListBlocks(ctx, "p")
		require.NoError(t, err)
		return len(blocks)
	}
	next = memstore.Refuse
	_, err := fs.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	require.ErrorIs(t, err, retry.ErrRefused)
	require.ErrorIs(t, err, retry.ErrUnavailable)
	require.Zero(t, claims())
	next = memstore.Lost
	_, err = fs.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	require.ErrorIs(t, err, retry.ErrUnavailable)
	require.False(t, errors.Is(err, retry.ErrRefused))
	require.Zero(t, claims())
	next = memstore.Unknown
	_, err = fs.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	require.ErrorIs(t, err, retry.ErrUnavailable)
	require.False(t, errors.Is(err, retry.ErrRefused))
	require.Equal(t, 1, claims(), "applied")
	next = memstore.Pass
	_, err = fs.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	var ce *records.ClaimError
	require.ErrorAs(t, err, &ce, "read back, the claim is its own")
	require.Equal(t, lease, ce.ClaimLease)
	require.Equal(t, slices.Repeat([]memstore.Call{{Op: "Claim", Arg: block}}, 4), seen)
}

// Reservations share one lease for a quarter of the TTL, then the next
// is put on a new lease.
func TestReservationLeaseShared(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	res, err := s.Claim(ctx, "p", block, records.Claim{Node: "n1"}, s.Grant(time.Hour))
	require.NoError(t, err)
	lease := func(a netip.Addr) int64 {
		_, err := s.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a, Record: rec(records.StateReserved), Reserve: true}})
		require.NoError(t, err)
		got, err := s.GetIPs(ctx, []records.IPRef{{Pool: "p", Block: block, Addr: a}})
		require.NoError(t, err)
		return got[a].Lease
	}
	first := lease(netip.MustParseAddr("10.0.0.1"))
	s.Advance(29 * time.Second)
	require.Equal(t, first, lease(netip.MustParseAddr("10.0.0.2")))
	s.Advance(time.Second)
	require.NotEqual(t, first, lease(netip.MustParseAddr("10.0.0.3")))
}
