package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestEtcdLeaderLoss stops the etcd leader of a 3-member cluster while
// four nodes allocate concurrently. Requests in flight may fail and are
// retried by their caller, as the CNI runtime retries an ADD; no address
// is ever handed to two owners, and the store stays consistent.
func TestEtcdLeaderLoss(t *testing.T) {
	ctx := context.Background()
	c := etcdtest.StartCluster(t, 3)
	pool := allocator.Pool{Name: "ha", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.50.0.0/22")}, BlockSizeV4: 27}
	admin, err := kvstore.Connect(ctx, c.Config(), etcdstore.HealthKey())
	require.NoError(t, err)
	defer admin.Close()
	_, err = etcdstore.New(admin, etcdstore.Options{}).EnsurePool(ctx, pool)
	require.NoError(t, err)

	var mu sync.Mutex
	holder := map[netip.Addr]string{}
	var done, failed atomic.Int64
	stopLeader := make(chan struct{})
	var wg sync.WaitGroup
	for n := range 4 {
		cli, err := kvstore.Connect(ctx, c.Config(), etcdstore.HealthKey())
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		sess, err := kvstore.NewSession(ctx, cli, 10)
		require.NoError(t, err)
		t.Cleanup(sess.Close)
		al, err := nodealloc.New(nodealloc.Config{Node: fmt.Sprintf("n%d", n), Store: etcdstore.New(cli, etcdstore.Options{})})
		require.NoError(t, err)
		require.NoError(t, al.Restore(ctx, sess))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 150; i++ {
				if n == 0 && i == 50 {
					close(stopLeader)
				}
				o := records.Owner{ContainerID: fmt.Sprintf("n%d-%d", n, i), IfName: "eth0"}
				for attempt := 0; ; attempt++ {
					rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
					res, err := al.Allocate(rctx, nodealloc.Request{Pool: "ha", Owner: o})
					cancel()
					if err == nil {
						mu.Lock()
						for _, a := range res.Allocations {
							if prev, ok := holder[a.Addr]; ok && prev != o.Key() {
								t.Errorf("%s handed to %s and %s", a.Addr, prev, o.Key())
							}
							holder[a.Addr] = o.Key()
						}
						mu.Unlock()
						done.Add(1)
						break
					}
					if errors.Is(err, records.ErrExhausted) || attempt == 20 {
						t.Errorf("allocate %s: %v", o.Key(), err)
						return
					}
					failed.Add(1)
				}
			}
		}()
	}
	<-stopLeader
	for _, m := range c.Members {
		if m.IsLeader() {
			m.Close()
			t.Log("stopped the etcd leader")
			break
		}
	}
	wg.Wait()
	t.Logf("%d allocations, %d attempts failed during the leader change and were retried", done.Load(), failed.Load())
	require.Equal(t, int64(600), done.Load())
	checkInvariants(t, admin, "ha")
	require.Len(t, storeIPs(t, admin, "ha"), 600)
}
