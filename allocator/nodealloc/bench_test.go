package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// benchPool is large enough that no benchmark run exhausts it.
var benchPool = allocator.Pool{Name: "bench", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.128.0.0/10")}, BlockSizeV4: 24}

var floorSeq atomic.Int64

// floorTxn is the cheapest write kvipam could make: one create-if-absent
// transaction on one key, the same shape as an allocation without the
// claim fence. Every allocator benchmark reports itself against it,
// measured in the same run on the same etcd.
func floorTxn(b *testing.B, cli *clientv3.Client) time.Duration {
	key := fmt.Sprintf("/floor/%d", floorSeq.Add(1))
	start := time.Now()
	if _, err := etcdtest.CreateJSON(context.Background(), cli, key, map[string]string{"owner": "x"}); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

func report(b *testing.B, floor, op time.Duration, perOp int) {
	n := float64(b.N * perOp)
	b.ReportMetric(float64(floor.Nanoseconds())/float64(b.N), "floor-ns/txn")
	b.ReportMetric(float64(op.Nanoseconds())/n, "ns/ip")
	b.ReportMetric(float64(op.Nanoseconds())/n/(float64(floor.Nanoseconds())/float64(b.N)), "x-floor")
}

// BenchmarkAllocate interleaves one floor transaction and one allocation
// (and, for release, one release) per iteration so both see the same load.
func BenchmarkAllocate(b *testing.B) {
	e := etcdtest.Start(b)
	ensurePool(b, e, benchPool)
	n := startNode(b, e, "bench", []string{"bench"}, nodeOpts{})
	ctx := context.Background()
	seq := 0
	b.Run("allocate", func(b *testing.B) {
		var floor, op time.Duration
		for i := 0; i < b.N; i++ {
			floor += floorTxn(b, n.cli)
			seq++
			start := time.Now()
			if _, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "bench", Owner: owner(seq)}); err != nil {
				b.Fatal(err)
			}
			op += time.Since(start)
		}
		report(b, floor, op, 1)
	})
	b.Run("allocate+release", func(b *testing.B) {
		var floor, op time.Duration
		for i := 0; i < b.N; i++ {
			floor += floorTxn(b, n.cli)
			seq++
			start := time.Now()
			if _, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "bench", Owner: owner(seq)}); err != nil {
				b.Fatal(err)
			}
			if _, err := n.alloc.Release(ctx, owner(seq)); err != nil {
				b.Fatal(err)
			}
			op += time.Since(start)
		}
		report(b, floor, op, 1)
	})
	b.Run("reserve+confirm", func(b *testing.B) {
		var floor, op time.Duration
		for i := 0; i < b.N; i++ {
			floor += floorTxn(b, n.cli)
			seq++
			start := time.Now()
			if _, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "bench", Owner: owner(seq), Reserve: true}); err != nil {
				b.Fatal(err)
			}
			if _, err := n.alloc.Confirm(ctx, owner(seq)); err != nil {
				b.Fatal(err)
			}
			op += time.Since(start)
		}
		report(b, floor, op, 1)
	})
	b.Run("batch-32", func(b *testing.B) {
		var floor, op time.Duration
		reqs := make([]nodealloc.Request, 32)
		for i := 0; i < b.N; i++ {
			floor += floorTxn(b, n.cli)
			for j := range reqs {
				seq++
				reqs[j] = nodealloc.Request{Pool: "bench", Owner: owner(seq)}
			}
			start := time.Now()
			for _, o := range n.alloc.AllocateBatch(ctx, reqs) {
				if o.Err != nil {
					b.Fatal(o.Err)
				}
			}
			op += time.Since(start)
		}
		report(b, floor, op, len(reqs))
	})
}
