package memstore_test

import (
	"net/netip"
	"testing"

	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/allocator/records/storetest"
)

// TestConformance holds the in-memory store to the store contract, the
// suite etcdstore passes on a real etcd.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s := memstore.New(memstore.Options{})
		return storetest.Harness{Store: s, Grant: s.Grant, Revoke: s.Revoke, Now: s.Now,
			NodeLive: func(node string, live bool) { s.NodeDown(node, !live) },
			Importer: s, NodeOn: s.NodeOnLease,
			History: func(pool string, a netip.Addr) []storetest.Interval {
				var out []storetest.Interval
				for _, h := range s.HistoryOf(pool, a) {
					out = append(out, storetest.Interval{Owner: h.Owner, Node: h.Node, Reason: h.Reason})
				}
				return out
			},
		}
	})
}
