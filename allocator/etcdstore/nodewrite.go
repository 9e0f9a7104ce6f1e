package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// One name, one agent (docs/design.md, invariant 9). A node's record is
// written only through WriteNode, which never replaces the record of
// another incarnation of the node's name: while one agent holds the name
// (its record lives on its lease), a second one, started on another
// machine or a clone of it under the same name, is refused, and an agent
// that comes back from a partition to find the name held by another is
// refused too.

// ErrNodeTaken marks a node record write refused because another
// incarnation of the node's name holds the record: two agents run under
// one name. The error is a *NodeTakenError.
var ErrNodeTaken = errors.New("node name taken by another agent")

// NodeTakenError is ErrNodeTaken with both incarnations: Mine, the record
// the refused agent meant to write, and Holder, the record etcd holds,
// whose Lease is the lease its key is on.
type NodeTakenError struct {
	Mine, Holder NodeRecord
}

func (e *NodeTakenError) Error() string {
	lease := fmt.Sprintf("its node record on lease %x, which lives while that agent keeps it alive", e.Holder.Lease)
	if e.Holder.Lease == 0 {
		// Not an agent's: agents write the record on their lease.
		lease = fmt.Sprintf("its node record on no lease, so it never expires: if no agent runs under the name, delete %s", NodeKey(e.Holder.Name))
	}
	return fmt.Sprintf("node name %q is held by another agent (%s, version %s, started %s, %s); this agent is %s: node names must be unique",
		e.Holder.Name, e.Holder.Incarnation(), orNone(e.Holder.Version), e.Holder.StartedAt.Format(time.RFC3339), lease,
		e.Mine.Incarnation())
}

// Unwrap makes a NodeTakenError an ErrNodeTaken.
func (e *NodeTakenError) Unwrap() error { return ErrNodeTaken }

// SameIncarnation reports whether r and o are records of one agent
// incarnation: the same boot ID and the same node addresses, in any
// order. Two agents under one name differ in one or both (another machine
// has another boot ID; a clone or a second agent on the same host, in
// another network namespace, other addresses), while an agent restarted
// on its machine is the same incarnation and may replace its own record
// at once.
func (r NodeRecord) SameIncarnation(o NodeRecord) bool {
	a, b := slices.Clone(r.Addresses), slices.Clone(o.Addresses)
	slices.Sort(a)
	slices.Sort(b)
	return r.BootID == o.BootID && slices.Equal(a, b)
}

// Incarnation names r's incarnation for people: its boot ID and addresses.
func (r NodeRecord) Incarnation() string {
	addrs := "no addresses"
	if len(r.Addresses) > 0 {
		addrs = "addresses " + strings.Join(r.Addresses, ",")
	}
	return fmt.Sprintf("boot ID %s, %s", orNone(r.BootID), addrs)
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// maxNodeWrites bounds WriteNode's attempts when its own incarnation
// rewrites the record between its read and its write (the agent writes
// the record on a new lease and with lost endpoints at the same time).
const maxNodeWrites = 4

// WriteNode writes r, the node record, on lease: the one write of a node
// record. It creates the record if there is none, and replaces a record of
// the same incarnation (SameIncarnation) only if it is unchanged since it
// was read; a record of another incarnation is left as it is, and the
// write fails with a *NodeTakenError. A lease etcd no longer has is
// records.ErrLeaseLost. A write whose outcome is unknown (its answer
// lost, a deadline) is settled as every write is, by reading the record
// back: written if it holds r on lease.
func (s *Store) WriteNode(ctx context.Context, r NodeRecord, lease int64) error {
	val, err := kvstore.EncodeJSON(r)
	if err != nil {
		return err
	}
	key := NodeKey(r.Name)
	fence := kvstore.Absent(key)
	for range maxNodeWrites {
		resp, err := s.kv.Txn(ctx).
			If(fence).
			Then(clientv3.OpPut(key, val, clientv3.WithLease(clientv3.LeaseID(lease)))).
			Else(clientv3.OpGet(key)).
			Commit()
		if err != nil {
			return s.settleNode(ctx, r, val, lease, fmt.Errorf("write node record %s: %w", r.Name, leaseErr(kvstore.Unavailable(err))))
		}
		if resp.Succeeded {
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			fence = kvstore.Absent(key)
			continue
		}
		held, err := heldNode(kvs[0])
		if err != nil {
			return fmt.Errorf("write node record %s: the record etcd holds cannot be read (delete it if no agent runs under the name): %w", r.Name, err)
		}
		if !held.SameIncarnation(r) {
			return &NodeTakenError{Mine: r, Holder: held}
		}
		fence = kvstore.Unchanged(key, kvs[0].ModRevision)
	}
	return fmt.Errorf("write node record %s: rewritten by this agent %d times meanwhile: %w", r.Name, maxNodeWrites, retry.ErrConflict)
}

// settleNode settles the node record write of r (encoded as val) that
// failed with err. A write etcd refused (the lease gone, or refused
// before proposing) or any error that is not a failure to answer is
// known not to be written; otherwise the record is read back.
func (s *Store) settleNode(ctx context.Context, r NodeRecord, val string, lease int64, err error) error {
	if !errors.Is(err, retry.ErrUnavailable) || errors.Is(err, retry.ErrRefused) || errors.Is(err, records.ErrLeaseLost) {
		return err
	}
	resp, rerr := s.kv.Get(ctx, NodeKey(r.Name))
	switch {
	case rerr != nil:
		return fmt.Errorf("%w; its outcome is unknown and the record could not be read back (%v)", err, rerr)
	case len(resp.Kvs) == 0:
		return fmt.Errorf("%w; read back: not written", err)
	case string(resp.Kvs[0].Value) == val && resp.Kvs[0].Lease == lease:
		return nil
	}
	if held, derr := heldNode(resp.Kvs[0]); derr == nil && !held.SameIncarnation(r) {
		return &NodeTakenError{Mine: r, Holder: held}
	}
	return fmt.Errorf("%w; read back: not written", err)
}

// heldNode decodes a node record as etcd holds it, its Lease the lease
// the key is on (what keeps it alive) and its Revision the key's.
func heldNode(kv *mvccpb.KeyValue) (NodeRecord, error) {
	v, err := kvstore.Decode[NodeRecord](kv)
	if err != nil {
		return NodeRecord{}, err
	}
	v.Value.Lease, v.Value.Revision = kv.Lease, kv.ModRevision
	return v.Value, nil
}

// ReadNode reads node's record as etcd holds it (heldNode); ok is false
// when there is none.
func (s *Store) ReadNode(ctx context.Context, node string) (r NodeRecord, ok bool, err error) {
	resp, err := s.kv.Get(ctx, NodeKey(node))
	if err != nil {
		return NodeRecord{}, false, fmt.Errorf("read node record %s: %w", node, kvstore.Unavailable(err))
	}
	if len(resp.Kvs) == 0 {
		return NodeRecord{}, false, nil
	}
	r, err = heldNode(resp.Kvs[0])
	if err != nil {
		return NodeRecord{}, false, fmt.Errorf("read node record %s: %w", node, err)
	}
	return r, true, nil
}

// LeaseTTL is what etcd says of a lease at one moment.
type LeaseTTL struct {
	// Found is false once etcd no longer has the lease (it expired or
	// was revoked, and the keys on it went with it).
	Found bool
	// Remaining is the lease's time to live in whole seconds, truncated
	// as etcd reports it; 0 or less for a lease etcd has let expire but
	// not yet revoked. Granted is the TTL it was granted with.
	Remaining, Granted int64
	// Term is the raft term of the member that answered. A new leader
	// refreshes every lease's time to live (etcd extends leases across
	// a leader change), so readings of two terms do not compare.
	Term uint64
}

// ReadLeaseTTL asks etcd for lease's remaining time to live.
func (s *Store) ReadLeaseTTL(ctx context.Context, lease int64) (LeaseTTL, error) {
	resp, err := s.leases.TimeToLive(ctx, clientv3.LeaseID(lease))
	if err != nil {
		return LeaseTTL{}, fmt.Errorf("read lease %x: %w", lease, kvstore.Unavailable(err))
	}
	// etcd answers a lease it does not have with TTL -1 and no granted
	// TTL; every lease it has was granted one of at least a second.
	return LeaseTTL{Found: resp.GrantedTTL > 0, Remaining: resp.TTL, Granted: resp.GrantedTTL, Term: resp.GetRaftTerm()}, nil
}
