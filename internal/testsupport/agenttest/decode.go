package agenttest

import (
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// DecodeAllocations turns allocation key-values of pool, as a test read
// them straight from etcd, into Allocations; any key that is not an
// allocation is an error.
func DecodeAllocations(pool string, kvs []*mvccpb.KeyValue) ([]records.Allocation, error) {
	out := make([]records.Allocation, 0, len(kvs))
	for _, kv := range kvs {
		a, err := etcdstore.DecodeAllocation(pool, kv)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}
