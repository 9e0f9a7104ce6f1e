package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// BenchmarkClaimCost says what a cold start's transactions cost etcd and
// this process, one kind at a time: KVIPAM_STORM_NODES (default 1,000)
// nodes, each on its own lease as in BenchmarkClaimStorm, send one
// transaction each at once, through the node's store (etcdstore.Store,
// the code the allocators run), with no allocator around it:
//
//   - bare: the storm's baseline, a create-if-absent of one key;
//   - claim: a block's claim and home (Store.Claim with no first address);
//   - claim-first: the same with the block's first address, as a storm
//     node's winning claim is;
//   - lost: claim-first of a block another node holds, as a storm node's
//     lost claim is (its Else reads why);
//   - bare-again, to see the first bare's figures hold.
//
// Each kind is reported as its seconds (s/<kind>), and the etcd members'
// and this process's CPU (etcd-cpu-s/<kind>, process-cpu-s/<kind>).
// A storm of n nodes with c conflicts does n claim-first and c lost; its
// ratio above (n claim-first + c lost) / n bare is the allocator's own.
// With KVIPAM_FILL_PROFILE set to a directory, CPU profiles of the
// leading member and of this process over each kind's first second are
// written there (etcd-cost-<kind>.pprof, fleet-cost-<kind>.pprof).
func BenchmarkClaimCost(b *testing.B) {
	nodes := envInt(b, "KVIPAM_STORM_NODES", 1000)
	forEachBackend(b, func(b *testing.B, backend string) { claimCost(b, backend, nodes) })
}

func claimCost(b *testing.B, backend string, n int) {
	b.StopTimer()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	f := newFleet(b, backend, "cost")
	// The nodes start as the storm's do, leases and restored allocators,
	// so this process holds what it holds in the storm; only their
	// leases are used.
	_, sessions := f.start(ctx, 0, n, 15, nil)
	stores := make([]*etcdstore.Store, len(f.clis))
	for i, c := range f.clis {
		stores[i] = etcdstore.New(c, etcdstore.Options{CallTimeout: f.callTimeout})
	}
	p, err := stores[0].GetPool(ctx, f.pool)
	if err != nil {
		b.Fatal(err)
	}
	cidr, bits := p.CIDRs[0], p.BlockSizeV4
	if blocks := allocator.BlockCount(cidr, bits); uint64(2*n) > blocks {
		b.Fatalf("%d nodes need %d blocks of the pool's %d", n, 2*n, blocks)
	}
	claim := func(i, k int, first bool) error {
		bl, err := allocator.BlockAt(cidr, bits, uint64(k)) // the pool's kth block
		if err != nil {
			return err
		}
		c := records.Claim{Node: nodeName(i), ClaimedAt: time.Now(), PoolRev: p.Rev}
		if first {
			c.First = &records.IPWrite{Pool: f.pool, Block: bl, Addr: bl.Addr().Next(),
				Record: records.Record{Owner: owner(i), Node: nodeName(i), State: records.StateAllocated, Since: time.Now()}}
		}
		_, err = stores[i%len(stores)].Claim(ctx, f.pool, bl, c, sessions[i].ID())
		return err
	}
	bare := func(prefix string) func(i int) error {
		return func(i int) error {
			_, err := etcdtest.CreateJSON(ctx, f.clis[i%len(f.clis)], fmt.Sprintf("/claim-cost/%s/%d", prefix, i), map[string]string{"owner": "x"})
			return err
		}
	}
	kinds := []struct {
		name string
		op   func(i int) error
	}{
		{"bare", bare("bare")},
		{"claim-first", func(i int) error { return claim(i, i, true) }},
		{"claim", func(i int) error { return claim(i, n+i, false) }},
		{"lost", func(i int) error {
			// The block node i+1 holds (claim-first).
			err := claim(i, (i+1)%n, true)
			if ce := (*records.ClaimError)(nil); errors.As(err, &ce) && ce.ClaimedBy == nodeName((i+1)%n) {
				return nil
			}
			return fmt.Errorf("claim of a held block: want a ClaimError naming its holder, got %v", err)
		}},
		{"bare-again", bare("again")},
	}
	for _, k := range kinds {
		errs := make([]error, n)
		prof := f.startProfiles(ctx, time.Second)
		c0 := f.sampleCPU()
		took := storm(n, func(i int) error { errs[i] = k.op(i); return nil })
		cpu := f.sampleCPU().sub(c0)
		f.stopProfiles(prof, "cost-"+k.name)
		if err := errors.Join(errs...); err != nil {
			b.Fatalf("%s: %v", k.name, err)
		}
		b.Logf("%-12s %7.1f ms, CPU etcd %.2f s, process %.2f s, %d B allocated a node", k.name, float64(took)/float64(time.Millisecond), cpu.etcd.Seconds(), cpu.process.Seconds(), cpu.allocated/uint64(n))
		b.ReportMetric(took.Seconds(), "s/"+k.name)
		b.ReportMetric(cpu.process.Seconds(), "process-cpu-s/"+k.name)
		if f.etcdCPU != nil {
			b.ReportMetric(cpu.etcd.Seconds(), "etcd-cpu-s/"+k.name)
		}
	}
}
