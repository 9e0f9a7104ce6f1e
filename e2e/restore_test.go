package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestRestoreFromOlderSnapshot: two nodes' agents run against a 3-member
// etcd cluster; node a has a pod, etcd is snapshotted, node a gets eight
// more pods (filling its block and claiming a second one). etcd is
// restored from the snapshot (etcdutl --bump-revision --mark-compacted)
// while the agents run. Node a re-asserts every missing allocation (the
// second block's claim too, which etcd lost), node b's new allocations
// never get one of node a's addresses, and an address that another owner
// holds in etcd (as another restore could leave it) is not taken back
// but reported by kvipamctl check, which exits non-zero naming it.
func TestRestoreFromOlderSnapshot(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := cluster.Start(t, cluster.Options{})
	a, b := newNode(t, "ra"), newNode(t, "rb")
	for _, n := range []*node{a, b} {
		n.startAgent(agentOpts{pools: []string{"default=10.9.0.0/24"}, blockV4: 29, etcd: c, gcInterval: time.Second,
			extra: []string{"--routing", "none"}})
	}
	la := a.kvipamList("kv", "1.0.0", "")
	owners := map[netip.Addr]string{} // node a's endpoints: address -> container
	addPod := func(name string) {
		p := newPod(t, name)
		v4, _ := podAddrs(t, a.mustAdd(la, p))
		owners[v4] = p.rt.ContainerID
	}
	addPod("before")
	snap := filepath.Join(t.TempDir(), "etcd.db")
	snapRev, err := c.Snapshot(ctx, 0, snap)
	require.NoError(t, err)
	for i := range 8 {
		addPod(fmt.Sprintf("after%d", i))
	}
	require.Len(t, a.poolStatus("default", "ipv4").Blocks, 2, "the later pods took a second block")

	require.NoError(t, c.RestoreFrom(ctx, snap, 1_000_000))
	cli := c.Client(t, cluster.RootUser)
	lost := 0
	for addr := range owners {
		if ownerIn(t, cli, addr) == "" {
			lost++
		}
	}
	t.Logf("etcd restored to revision %d: %d of node a's %d allocations missing", snapRev, lost, len(owners))
	require.Equal(t, 8, lost, "the allocations after the snapshot are gone from etcd")

	began := time.Now()
	waitFor(t, 30*time.Second, "node a to re-assert its allocations", func() bool {
		for addr, id := range owners {
			if ownerIn(t, cli, addr) != id {
				return false
			}
		}
		return true
	})
	t.Logf("node a re-asserted them %s after the cluster was back", time.Since(began).Round(time.Millisecond))

	// Node b allocates after the restore: never one of node a's addresses.
	l := newIPAMLoad(t, b)
	for i := range 12 {
		r, err := l.exec("ADD", fmt.Sprintf("b-%02d", i))
		require.NoError(t, err)
		got := netip.MustParseAddr(r.IPs[0].Address.IP.String())
		require.NotContains(t, owners, got, "node b got node a's address %s", got)
	}

	// Another owner holds one of node a's addresses in etcd: node a does
	// not take it back and reports it.
	var victim netip.Addr
	for addr := range owners {
		victim = addr
		break
	}
	key := keyOf(t, cli, victim)
	_, err = cli.Put(ctx, key, `{"containerID":"intruder","ifName":"eth0","node":"elsewhere","state":"allocated","since":"2026-11-23T00:00:00Z"}`)
	require.NoError(t, err)
	ctl := a.clusterCtl(c)
	var out []byte
	waitFor(t, 30*time.Second, "kvipamctl check to report the address node a could not re-assert", func() bool {
		out, err = ctl("check")
		return err != nil && strings.Contains(string(out), victim.String()) && strings.Contains(string(out), "could not re-assert")
	})
	t.Logf("kvipamctl check:\n%s", out)
	require.Equal(t, "intruder", ownerIn(t, cli, victim), "not taken back")
	for addr, id := range owners {
		if addr != victim {
			require.Equal(t, id, ownerIn(t, cli, addr))
		}
	}
}

// ownerIn is the container that holds addr in etcd, or "".
func ownerIn(t *testing.T, cli *clientv3.Client, addr netip.Addr) string {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		al, err := etcdstore.DecodeAllocation("default", kv)
		if err == nil && al.Addr == addr {
			return al.ContainerID
		}
	}
	return ""
}

// keyOf is the etcd key of addr's allocation.
func keyOf(t *testing.T, cli *clientv3.Client, addr netip.Addr) string {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if al, err := etcdstore.DecodeAllocation("default", kv); err == nil && al.Addr == addr {
			return string(kv.Key)
		}
	}
	t.Fatalf("no allocation of %s", addr)
	return ""
}
