package storetest

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

var ipTests = []test{
	{"ips/write-list-get", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a1, a2 := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.10")
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a2, Record: f.rec(2, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a1, Record: f.rec(1, "n1", records.StateAllocated)},
		})
		require.NoError(t, err)
		require.Greater(t, res.Rev, rev)
		require.True(t, res.Expires.IsZero(), "no reservation")
		list, err := f.Store.ListIPs(f.ctx, "p", blockA)
		require.NoError(t, err)
		require.Len(t, list, 2)
		want := map[netip.Addr]records.Allocation{
			a1: {Record: f.rec(1, "n1", records.StateAllocated), Pool: "p", Block: blockA, Addr: a1, Rev: res.Rev},
			a2: {Record: f.rec(2, "n1", records.StateAllocated), Pool: "p", Block: blockA, Addr: a2, Rev: res.Rev},
		}
		for _, al := range list {
			require.Equal(t, want[al.Addr], al)
		}
		got, err := f.Store.GetIPs(f.ctx, []records.IPRef{{Pool: "p", Block: blockA, Addr: a1}, {Pool: "p", Block: blockA, Addr: a2}, {Pool: "p", Block: blockA, Addr: netip.MustParseAddr("10.0.0.5")}})
		require.NoError(t, err)
		require.Equal(t, want, got)
		empty, err := f.Store.ListIPs(f.ctx, "p", blockB)
		require.NoError(t, err)
		require.Empty(t, empty)
		none, err := f.Store.WriteIPs(f.ctx, nil)
		require.NoError(t, err)
		require.Zero(t, none.Rev, "an empty batch writes nothing")
	}},
	{"ips/fenced-by-claim", func(t *testing.T, f *fixture) {
		rev, lease := f.claim(t, "n1", blockA)
		revB, _ := f.claim(t, "n1", blockB)
		a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.17")
		w := []records.IPWrite{
			{Pool: "p", Block: blockB, ClaimRev: revB, Addr: b, Record: f.rec(2, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: rev + 100, Addr: a, Record: f.rec(1, "n1", records.StateAllocated)},
		}
		_, err := f.Store.WriteIPs(f.ctx, w)
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.ErrorIs(t, err, retry.ErrConflict)
		require.Equal(t, records.WriteError{Fenced: []netip.Prefix{blockA}}, *we)
		f.absent(t, blockB, b) // all or nothing
		// The claim gone with its lease fences every write into the block.
		f.Revoke(lease)
		w[1].ClaimRev = rev
		_, err = f.Store.WriteIPs(f.ctx, w)
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Fenced: []netip.Prefix{blockA}}, *we)
		f.absent(t, blockA, a)
		// Another node's claim fences too.
		revC, _ := f.claim(t, "n2", blockC)
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockC, ClaimRev: revC - 1, Addr: netip.MustParseAddr("10.0.0.33"), Record: f.rec(3, "n1", records.StateAllocated)}})
		require.ErrorAs(t, err, &we)
		require.Equal(t, []netip.Prefix{blockC}, we.Fenced)
	}},
	{"ips/taken-and-confirm", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
		res := f.write(t, blockA, rev, a, f.rec(1, "n1", records.StateReserved), true)
		require.NotZero(t, res.Lease)
		// Taken: a create of an address that exists.
		_, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: b, Record: f.rec(2, "n1", records.StateAllocated)},
			{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: f.rec(2, "n1", records.StateAllocated)},
		})
		var we *records.WriteError
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Taken: []netip.Addr{a}}, *we)
		f.absent(t, blockA, b)
		// A confirm at another revision: taken.
		conf := records.IPWrite{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: f.rec(1, "n1", records.StateAllocated), PrevRev: res.Rev + 100}
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{conf})
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Taken: []netip.Addr{a}}, *we)
		// A confirm at its revision makes it permanent: no lease.
		conf.PrevRev = res.Rev
		conf.Reserve = true // ignored for a confirm
		wr, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{conf})
		require.NoError(t, err)
		require.True(t, wr.Expires.IsZero())
		al := f.get(t, blockA, a, wr.Rev)
		require.Zero(t, al.Lease)
		require.Equal(t, records.StateAllocated, al.State)
		// Fenced and taken at once.
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev + 1, Addr: a, Record: f.rec(3, "n1", records.StateAllocated)}})
		require.ErrorAs(t, err, &we)
		require.Equal(t, records.WriteError{Fenced: []netip.Prefix{blockA}, Taken: []netip.Addr{a}}, *we)
	}},
	{"ips/reservation-lease", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
		res, err := f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: f.rec(1, "n1", records.StateReserved), Reserve: true}})
		require.NoError(t, err)
		near(t, f.Now().Add(2*time.Minute+30*time.Second), res.Expires, "the reservation lease: the TTL and its sharing window")
		al := f.get(t, blockA, a, res.Rev)
		exp, err := f.Store.LeaseExpiry(f.ctx, al.Lease)
		require.NoError(t, err)
		near(t, res.Expires, exp, "LeaseExpiry of the reservation lease")
		// Reservations made soon after share the lease.
		bl := f.write(t, blockA, rev, b, f.rec(2, "n1", records.StateReserved), true)
		require.Equal(t, al.Lease, bl.Lease)
		// Its end takes every reservation on it.
		f.Revoke(al.Lease)
		f.absent(t, blockA, a)
		f.absent(t, blockA, b)
		exp, err = f.Store.LeaseExpiry(f.ctx, al.Lease)
		require.NoError(t, err)
		near(t, f.Now(), exp, "a lease that has ended ends now")
		// The next reservation finds the lease gone: a lost race, nothing
		// written, and its retry is put on a new lease.
		w := []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: a, Record: f.rec(1, "n1", records.StateReserved), Reserve: true}}
		_, err = f.Store.WriteIPs(f.ctx, w)
		require.ErrorIs(t, err, retry.ErrConflict)
		f.absent(t, blockA, a)
		res, err = f.Store.WriteIPs(f.ctx, w)
		require.NoError(t, err)
		require.NotEqual(t, al.Lease, f.get(t, blockA, a, res.Rev).Lease)
	}},
	{"ips/lease-expiry", func(t *testing.T, f *fixture) {
		lease := f.Grant(time.Minute)
		exp, err := f.Store.LeaseExpiry(f.ctx, lease)
		require.NoError(t, err)
		near(t, f.Now().Add(time.Minute), exp, "a live lease")
		f.Revoke(lease)
		exp, err = f.Store.LeaseExpiry(f.ctx, lease)
		require.NoError(t, err)
		near(t, f.Now(), exp, "a lease gone")
	}},
	{"ips/delete", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a := netip.MustParseAddr("10.0.0.4")
		al := f.write(t, blockA, rev, a, f.rec(1, "n1", records.StateAllocated), false)
		stale := al
		stale.Rev--
		require.ErrorIs(t, f.Store.DeleteIP(f.ctx, stale), retry.ErrConflict)
		f.get(t, blockA, a, al.Rev)
		zero := al
		zero.Rev = 0
		require.ErrorIs(t, f.Store.DeleteIP(f.ctx, zero), records.ErrBadRequest)
		before := f.Now()
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		f.absent(t, blockA, a)
		require.NoError(t, f.Store.DeleteIP(f.ctx, al), "absent is success")
		// The interval that ended is in history.
		last, err := f.Store.LastReleased(f.ctx, "p", []netip.Addr{a, netip.MustParseAddr("10.0.0.5")})
		require.NoError(t, err)
		require.Len(t, last, 1)
		near(t, before, last[a], "released now")
		other, err := f.Store.LastReleased(f.ctx, "q", []netip.Addr{a})
		require.NoError(t, err)
		require.Empty(t, other)
		// A second release later is the newest.
		al = f.write(t, blockA, rev, a, f.rec(2, "n1", records.StateAllocated), false)
		require.NoError(t, f.Store.DeleteIP(f.ctx, al))
		again, err := f.Store.LastReleased(f.ctx, "p", []netip.Addr{a})
		require.NoError(t, err)
		require.False(t, again[a].Before(last[a]))
	}},
	{"ips/record-lapsed", func(t *testing.T, f *fixture) {
		rev, _ := f.claim(t, "n1", blockA)
		a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
		al := f.write(t, blockA, rev, a, f.rec(1, "n1", records.StateReserved), true)
		end := f.Now()
		done, err := f.Store.RecordLapsed(f.ctx, al, end)
		require.NoError(t, err)
		require.False(t, done, "still held: not lapsed yet")
		// Confirmed in time by its owner: nothing ended.
		bl := f.write(t, blockA, rev, b, f.rec(2, "n1", records.StateReserved), true)
		_, err = f.Store.WriteIPs(f.ctx, []records.IPWrite{{Pool: "p", Block: blockA, ClaimRev: rev, Addr: b, Record: f.rec(2, "n1", records.StateAllocated), PrevRev: bl.Rev}})
		require.NoError(t, err)
		done, err = f.Store.RecordLapsed(f.ctx, bl, end)
		require.NoError(t, err)
		require.True(t, done)
		last, err := f.Store.LastReleased(f.ctx, "p", []netip.Addr{a, b})
		require.NoError(t, err)
		require.Empty(t, last)
		// Lapsed: recorded at its end.
		f.Revoke(al.Lease)
		done, err = f.Store.RecordLapsed(f.ctx, al, end)
		require.NoError(t, err)
		require.True(t, done)
		last, err = f.Store.LastReleased(f.ctx, "p", []netip.Addr{a})
		require.NoError(t, err)
		require.True(t, end.Equal(last[a]), "want %s, got %s", end, last[a])
		// Lapsed, then taken by another owner: recorded too.
		f.write(t, blockA, rev, a, f.rec(3, "n1", records.StateAllocated), false)
		done, err = f.Store.RecordLapsed(f.ctx, al, end.Add(time.Second))
		require.NoError(t, err)
		require.True(t, done)
		last, err = f.Store.LastReleased(f.ctx, "p", []netip.Addr{a})
		require.NoError(t, err)
		require.True(t, end.Add(time.Second).Equal(last[a]))
	}},
}
