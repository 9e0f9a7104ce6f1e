package agent

import (
	"context"
	"reflect"
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
	store interface {
		PutNode(ctx context.Context, rec etcdstore.NodeRecord, lease int64) error
	}
	node    string
	bootID  string
	version string
	addrs   []string
	labels  map[string]string

	mu   sync.Mutex
	lost []etcdstore.LostEndpoint
	// unwritten is set while lost has findings no successful write has
	// carried to etcd yet.
	unwritten bool
}

// write puts the record on lease.
func (r *nodeRecorder) write(ctx context.Context, lease int64) error {
	r.mu.Lock()
	lost, was := slices.Clone(r.lost), r.unwritten
	r.unwritten = false
	r.mu.Unlock()
	rec := etcdstore.NodeRecord{Name: r.node, BootID: r.bootID, Version: r.version, Addresses: r.addrs, Labels: r.labels,
		StartedAt: time.Now().UTC(), Lease: lease, LostEndpoints: lost}
	err := r.store.PutNode(ctx, rec, lease)
	if err != nil && was {
		r.mu.Lock()
		r.unwritten = true
		r.mu.Unlock()
	}
	return err
}

// addLost adds endpoints to the record's lost list, one entry per owner
// (the latest finding), and returns its length and whether the record
// needs writing: something but the time of a finding changed, or an
// earlier change was not written. A conflict found again on every
// reconciler pass does not rewrite the node record each time.
func (r *nodeRecorder) addLost(lost []etcdstore.LostEndpoint) (n int, write bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, le := range lost {
		i := slices.IndexFunc(r.lost, func(x etcdstore.LostEndpoint) bool { return x.Owner == le.Owner })
		if i < 0 {
			r.lost, r.unwritten = append(r.lost, le), true
			continue
		}
		prev := r.lost[i]
		prev.FoundAt = le.FoundAt
		if !reflect.DeepEqual(prev, le) {
			r.lost[i], r.unwritten = le, true
		}
	}
	return len(r.lost), r.unwritten
}
