package agent

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// nodeRecorder writes this node's record on the node lease: what other
// nodes route to (its addresses), who it is (boot ID, version), and the
// endpoints it found lost, which kvipamctl check reports. It is safe for
// concurrent use.
type nodeRecorder struct {
	put     func(ctx context.Context, rec etcdstore.NodeRecord, lease int64) error
	node    string
	bootID  string
	version string
	addrs   []string

	mu   sync.Mutex
	lost []etcdstore.LostEndpoint
}

// write puts the record on lease.
func (r *nodeRecorder) write(ctx context.Context, lease int64) error {
	r.mu.Lock()
	lost := slices.Clone(r.lost)
	r.mu.Unlock()
	rec := etcdstore.NodeRecord{Name: r.node, BootID: r.bootID, Version: r.version, Addresses: r.addrs,
		StartedAt: time.Now().UTC(), Lease: lease, LostEndpoints: lost}
	return r.put(ctx, rec, lease)
}

// addLost adds endpoints to the record's lost list and returns its length.
func (r *nodeRecorder) addLost(lost []etcdstore.LostEndpoint) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, le := range lost { // one entry per owner: the latest finding
		if i := slices.IndexFunc(r.lost, func(x etcdstore.LostEndpoint) bool { return x.Owner == le.Owner }); i >= 0 {
			r.lost[i] = le
			continue
		}
		r.lost = append(r.lost, le)
	}
	return len(r.lost)
}
