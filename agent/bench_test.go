package agent

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// BenchmarkSocketAllocate measures allocations per second through the
// unix socket (HTTP, JSON, group commit, fenced etcd write) at 1 and 200
// concurrent clients. In the same run it measures the floor: raw
// create-if-absent transactions from the same number of goroutines on the
// same etcd. x-floor above 1 means group commit beats one transaction per
// request.
func BenchmarkSocketAllocate(b *testing.B) {
	e := etcdtest.Start(b)
	cfg := testConfig(b, e)
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 22, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}}
	ta := startAgent(b, cfg, Options{})
	cli := etcdtest.Client(b, e)
	var seq atomic.Int64
	for _, conc := range []int{1, 200} {
		b.Run(fmt.Sprintf("clients=%d", conc), func(b *testing.B) {
			floor := run(b.N, conc, func() error {
				_, err := etcdtest.CreateJSON(context.Background(), cli, fmt.Sprintf("/floor/%d", seq.Add(1)), map[string]string{"containerID": "x"})
				return err
			})
			b.ResetTimer()
			took := run(b.N, conc, func() error {
				o := api.Owner{ContainerID: fmt.Sprintf("bench-%d", seq.Add(1)), IfName: "eth0"}
				_, err := ta.c.Allocate(context.Background(), api.AllocateRequest{Owner: o, Permanent: true})
				return err
			})
			b.StopTimer()
			allocs := float64(b.N) / took.Seconds()
			txns := float64(b.N) / floor.Seconds()
			b.ReportMetric(allocs, "allocs/s")
			b.ReportMetric(txns, "floor-txn/s")
			b.ReportMetric(allocs/txns, "x-floor")
		})
	}
}

// run does n calls of op from conc goroutines and returns the wall time.
func run(n, conc int, op func() error) time.Duration {
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Value
	start := time.Now()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if err := op(); err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := failed.Load().(error); ok {
		panic(fmt.Sprintf("benchmark op failed: %v", err))
	}
	return time.Since(start)
}
