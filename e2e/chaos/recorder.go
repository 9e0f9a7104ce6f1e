package chaos

import (
	"context"
	"net/netip"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// Recorder keeps every change of every allocation key, from etcd's first
// revision, by a watch: etcd's side of the history.
type Recorder struct {
	mu      sync.Mutex
	changes []Change
	homes   []HomeChange
	binds   []BindingChange
	backing []Backing
	cancel  context.CancelFunc
	done    chan struct{}
	err     error
}

// Record starts recording from revision 1. Stop ends it.
func Record(ctx context.Context, cli *clientv3.Client) *Recorder {
	ctx, cancel := context.WithCancel(ctx)
	r := &Recorder{cancel: cancel, done: make(chan struct{})}
	go r.run(ctx, cli)
	return r
}

func (r *Recorder) run(ctx context.Context, cli *clientv3.Client) {
	defer close(r.done)
	rev := int64(1)
	for ctx.Err() == nil {
		// One watch from the common root of allocations and homes.
		wc := cli.Watch(clientv3.WithRequireLeader(ctx), etcdstore.Prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
		for resp := range wc {
			if err := resp.Err(); err != nil {
				r.mu.Lock()
				r.err = err
				r.mu.Unlock()
				break
			}
			seen := time.Now()
			for _, ev := range resp.Events {
				r.add(ev, seen)
				rev = ev.Kv.ModRevision + 1
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond): // a member went: watch again from where it stopped
		}
	}
}

func (r *Recorder) add(ev *clientv3.Event, seen time.Time) {
	k, err := etcdstore.ParseKey(string(ev.Kv.Key))
	if err != nil {
		return
	}
	if b, ok := backingOf(k, ev, seen); ok {
		r.mu.Lock()
		r.backing = append(r.backing, b)
		r.mu.Unlock()
	}
	switch {
	case k.Kind == etcdstore.KeyBinding:
		b := BindingChange{Identity: k.Identity, Rev: ev.Kv.ModRevision, Seen: seen, Deleted: ev.Type == clientv3.EventTypeDelete}
		if v, err := kvstore.Decode[records.Binding](ev.Kv); err == nil && !b.Deleted {
			b = BindingOf(v.Value, b)
		}
		r.mu.Lock()
		r.binds = append(r.binds, b)
		r.mu.Unlock()
		return
	case k.Kind == etcdstore.KeyHome:
		h := HomeChange{Block: k.Block, Rev: ev.Kv.ModRevision, Deleted: ev.Type == clientv3.EventTypeDelete}
		if v, err := kvstore.Decode[records.Home](ev.Kv); err == nil {
			h.Node = v.Value.Node
		}
		r.mu.Lock()
		r.homes = append(r.homes, h)
		r.mu.Unlock()
		return
	case k.Kind != etcdstore.KeyIP || !k.Block.Contains(k.Addr):
		return // a lent address's home, or not an allocation
	}
	c := Change{Addr: k.Addr, Block: k.Block, Rev: ev.Kv.ModRevision, Seen: seen}
	if ev.Type == clientv3.EventTypeDelete {
		c.Deleted = true
	} else if v, err := kvstore.Decode[records.Record](ev.Kv); err == nil {
		c.Node, c.State, c.Borrowed = v.Value.Node, string(v.Value.State), v.Value.Borrowed
		if v.Value.ContainerID != "" {
			c.Owner = v.Value.Owner.Key()
		}
		c.Identity = v.Value.Identity
		if alt := v.Value.Alternate; alt != nil {
			c.Alternate, c.AltNode = alt.Owner.Key(), alt.Node
		}
	}
	r.mu.Lock()
	r.changes = append(r.changes, c)
	r.mu.Unlock()
}

// Stop ends the recording and returns every allocation change seen, and
// the last watch error (a compaction would lose history: the run must
// not compact).
func (r *Recorder) Stop() ([]Change, error) {
	r.cancel()
	<-r.done
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.changes, r.err
}

// Backing returns the changes of claims, lent addresses' homes and node
// records seen (after Stop): what entitles a node to announce a prefix.
func (r *Recorder) Backing() []Backing {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.backing
}

// backingOf is the Backing change an event is, if any.
func backingOf(k etcdstore.Key, ev *clientv3.Event, seen time.Time) (Backing, bool) {
	b := Backing{Deleted: ev.Type == clientv3.EventTypeDelete, Rev: ev.Kv.ModRevision, Seen: seen}
	switch k.Kind {
	case etcdstore.KeyClaim:
		b.Kind, b.Prefix = BackingClaim, k.Block
		if v, err := kvstore.Decode[records.Claim](ev.Kv); err == nil {
			b.Node = v.Value.Node
		}
	case etcdstore.KeyLent:
		b.Kind, b.Prefix = BackingLent, netip.PrefixFrom(k.Addr, k.Addr.BitLen())
		if v, err := kvstore.Decode[records.Home](ev.Kv); err == nil {
			b.Node = v.Value.Node
		}
	case etcdstore.KeyNode:
		b.Kind, b.Node = BackingNode, k.Node
	default:
		return Backing{}, false
	}
	return b, true
}

// Bindings returns the sticky bindings' changes seen (after Stop).
func (r *Recorder) Bindings() []BindingChange {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.binds
}

// BindingOf fills b (its place and revision set) from binding v.
func BindingOf(v records.Binding, b BindingChange) BindingChange {
	b.Addrs = v.Addrs
	if !v.Kept() {
		b.Owner, b.Node = v.Owner.Key(), v.Node
	}
	if alt := v.Alternate; alt != nil {
		b.Alternate, b.AltNode = alt.Owner.Key(), alt.Node
	}
	return b
}

// HolderOf is who record v names.
func HolderOf(v records.Record) Holder {
	h := Holder{Node: v.Node, State: string(v.State)}
	if v.ContainerID != "" {
		h.Owner = v.Owner.Key()
	}
	if v.Alternate != nil {
		h.Alternate = v.Alternate.Owner.Key()
	}
	return h
}

// Homes returns the block home changes seen (after Stop).
func (r *Recorder) Homes() []HomeChange {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.homes
}
