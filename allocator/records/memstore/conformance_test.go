package memstore_test

import (
	"testing"

	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/allocator/records/storetest"
)

// TestConformance holds the in-memory store to the store contract, the
// suite etcdstore passes on a real etcd.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		s := memstore.New(memstore.Options{})
		return storetest.Harness{Store: s, Grant: s.Grant, Revoke: s.Revoke, Now: s.Now}
	})
}
