package memstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// BenchmarkReserveConfirmRelease is one pod's life on the store, in a
// block beside 15 others' allocations, with the clock moving a second a
// pod: the cost of a step of a simulation on it.
func BenchmarkReserveConfirmRelease(b *testing.B) {
	ctx := context.Background()
	s := newStore(b)
	lease := s.Grant(30 * time.Second)
	res, err := s.Claim(ctx, "p", block, records.Claim{Node: "n1"}, lease)
	if err != nil {
		b.Fatal(err)
	}
	for i := range 15 {
		a := netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})
		if _, err := s.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a, Record: rec(records.StateAllocated)}}); err != nil {
			b.Fatal(err)
		}
	}
	a := netip.MustParseAddr("10.0.0.0")
	ref := []records.IPRef{{Pool: "p", Block: block, Addr: a}}
	for b.Loop() {
		s.Advance(time.Second)
		s.KeepAlive(lease)
		w := records.IPWrite{Pool: "p", Block: block, ClaimRev: res.Rev, Addr: a, Record: rec(records.StateReserved), Reserve: true}
		if _, err := s.WriteIPs(ctx, []records.IPWrite{w}); err != nil {
			b.Fatal(err)
		}
		got, _ := s.GetIPs(ctx, ref)
		w.PrevRev, w.Reserve, w.Record.State = got[a].Rev, false, records.StateAllocated
		if _, err := s.WriteIPs(ctx, []records.IPWrite{w}); err != nil {
			b.Fatal(err)
		}
		got, _ = s.GetIPs(ctx, ref)
		if err := s.DeleteIP(ctx, got[a]); err != nil {
			b.Fatal(err)
		}
	}
}
