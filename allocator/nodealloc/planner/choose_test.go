package planner

import (
	"net/netip"
	"testing"
	"time"

	"github.com/kvipam/kvipam/allocator"
)

// BenchmarkChooseBlock: choosing a block costs the same on a /10 and a
// /8 as on a /20 (the baseline, measured in the same run), with a quarter
// of the blocks already claimed by others.
func BenchmarkChooseBlock(b *testing.B) {
	setup := func(cidr string) (string, *Pool) {
		p := allocator.Pool{Name: "p", BlockSizeV4: 26, CIDRs: []netip.Prefix{netip.MustParsePrefix(cidr)}}
		ps := NewPool(p)
		n := p.BlockCount(allocator.IPv4)
		for i := uint64(0); i < n; i += 4 {
			blk, _ := allocator.BlockAt(p.CIDRs[0], 26, i)
			ps.others[blk] = otherBlock{node: "x"}
		}
		return "node-1", ps
	}
	choose := func(node string, ps *Pool) time.Duration {
		start := time.Now()
		blk, ok := ps.ChooseBlock(node, allocator.IPv4)
		d := time.Since(start)
		if !ok {
			b.Fatal("no block")
		}
		ps.others[blk] = otherBlock{node: "y"} // lost its race: the next choice moves on
		return d
	}
	small, smallPS := setup("10.0.0.0/20") // 64 blocks
	mid, midPS := setup("10.0.0.0/10")     // 65,536 blocks
	big, bigPS := setup("10.0.0.0/8")      // 262,144 blocks
	var base, midOp, bigOp time.Duration
	for i := 0; i < b.N; i++ {
		if i%32 == 0 {
			small, smallPS = setup("10.0.0.0/20") // never run the small pool full
		}
		base += choose(small, smallPS)
		midOp += choose(mid, midPS)
		bigOp += choose(big, bigPS)
	}
	b.ReportMetric(float64(base.Nanoseconds())/float64(b.N), "ns/choice-/20")
	b.ReportMetric(float64(midOp)/float64(base), "x-/20-on-/10")
	b.ReportMetric(float64(bigOp)/float64(base), "x-/20-on-/8")
}
