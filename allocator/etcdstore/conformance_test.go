package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records/storetest"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestConformance holds etcdstore to the store contract, the suite the
// in-memory store (allocator/records/memstore) passes too. One etcd
// serves every test; each starts from an empty keyspace, with no lease.
func TestConformance(t *testing.T) {
	cli := etcdtest.Client(t, etcdtest.Start(t))
	ctx := context.Background()
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		_, err := cli.Delete(ctx, "\x00", clientv3.WithFromKey())
		require.NoError(t, err)
		leases, err := cli.Leases(ctx)
		require.NoError(t, err)
		for _, l := range leases.Leases {
			_, err := cli.Revoke(ctx, l.ID)
			require.NoError(t, err)
		}
		st := etcdstore.New(cli, etcdstore.Options{})
		// The cluster runs at the highest level, as a cluster of this
		// version's agents does (a live migration needs level 3).
		raiser := etcdstore.NodeRecord{Name: "schema-raiser", Features: schema.Names()}
		require.NoError(t, st.WriteNode(ctx, raiser, 0))
		_, _, err = st.RaiseSchema(ctx, schema.Highest(), "test", "test")
		require.NoError(t, err)
		_, err = cli.Delete(ctx, etcdstore.NodeKey(raiser.Name))
		require.NoError(t, err)
		return storetest.Harness{
			Store: st,
			Grant: func(ttl time.Duration) int64 {
				resp, err := cli.Grant(ctx, int64((ttl+time.Second-1)/time.Second))
				require.NoError(t, err)
				return int64(resp.ID)
			},
			Revoke: func(id int64) {
				_, err := cli.Revoke(ctx, clientv3.LeaseID(id))
				require.NoError(t, err)
			},
			Now: time.Now,
			NodeLive: func(node string, live bool) {
				if !live {
					_, err := cli.Delete(ctx, etcdstore.NodeKey(node))
					require.NoError(t, err)
					return
				}
				if _, ok, err := st.ReadNode(ctx, node); err == nil && ok {
					return
				}
				require.NoError(t, st.WriteNode(ctx, etcdstore.NodeRecord{Name: node, Features: schema.Names()}, 0))
			},
			Importer: st,
			NodeOn: func(node string, lease int64) {
				require.NoError(t, st.WriteNode(ctx, etcdstore.NodeRecord{Name: node, Features: schema.Names()}, lease))
			},
			History: func(pool string, a netip.Addr) []storetest.Interval {
				hs, err := st.History(ctx, etcdstore.HistoryFilter{Pool: pool, IP: a})
				require.NoError(t, err)
				var out []storetest.Interval
				for _, h := range hs {
					out = append(out, storetest.Interval{Owner: h.Owner, Node: h.Node, Reason: h.Reason})
				}
				return out
			},
		}
	})
}
