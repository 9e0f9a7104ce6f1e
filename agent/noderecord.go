package agent

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore"
)

// nodeLeases grants the node's leases: each a new session whose node
// record is written on it.
type nodeLeases struct {
	cli      *clientv3.Client
	ttl      int64
	recorder *nodeRecorder
}

// grant takes a new node lease and writes the node record on it.
func (l nodeLeases) grant(ctx context.Context) (*kvstore.Session, error) {
	sess, err := kvstore.NewSession(ctx, l.cli, l.ttl)
	if err != nil {
		return nil, err
	}
	if err := l.recorder.write(ctx, sess.ID()); err != nil {
		if errors.Is(err, etcdstore.ErrNodeTaken) || errors.Is(err, errNameContested) {
			// Nothing is on the lease, and no write will be: end it now
			// rather than leave one behind per refused attempt. Bounded
			// by the TTL, after which it ends anyway.
			rctx, cancel := context.WithTimeout(ctx, time.Duration(l.ttl)*time.Second)
			defer cancel()
			_ = sess.Revoke(rctx)
			return nil, err
		}
		sess.Close()
		return nil, err
	}
	return sess, nil
}

// nodeRecorder writes this node's record on the node lease: what other
// nodes route to (its addresses), who it is (boot ID, version, when it
// started), and the endpoints it found lost, which kvipamctl check
// reports. Every write of the record is fenced (etcdstore.WriteNode): a
// write refused because another agent holds the node's name is told to
// the name guard, and once it is, nothing more is written (identity.go).
// It is safe for concurrent use.
type nodeRecorder struct {
	store interface {
		WriteNode(ctx context.Context, rec etcdstore.NodeRecord, lease int64) error
	}
	name interface {
		err() error
		seen(err error)
	}
	node    string
	bootID  string
	version string
	addrs   []string
	labels  map[string]string
	started time.Time
	// features are the schema features the agent understands.
	features []string

	mu   sync.Mutex
	lost []etcdstore.LostEndpoint
	// unwritten is set while lost has findings no successful write has
	// carried to etcd yet.
	unwritten bool
}

// incarnation is the record without a lease and lost endpoints: who
// this agent is.
func (r *nodeRecorder) incarnation() etcdstore.NodeRecord {
	return etcdstore.NodeRecord{Name: r.node, BootID: r.bootID, Version: r.version, Addresses: r.addrs, Labels: r.labels, StartedAt: r.started, Features: r.features}
}

// write puts the record on lease, unless another agent holds the name.
func (r *nodeRecorder) write(ctx context.Context, lease int64) error {
	if err := r.name.err(); err != nil {
		return err
	}
	r.mu.Lock()
	lost, was := slices.Clone(r.lost), r.unwritten
	r.unwritten = false
	r.mu.Unlock()
	rec := r.incarnation()
	rec.Lease, rec.LostEndpoints = lease, lost
	err := r.store.WriteNode(ctx, rec, lease)
	r.name.seen(err)
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
