package inspect

import (
	"encoding/json"
	"fmt"
	"net/netip"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// The add functions file one key-value into the snapshot, or into Bad when
// its key or value cannot be understood. They are lenient where the
// allocator is strict on purpose: an allocation whose address is not in
// its key's block is kept (Check reports it) rather than dropped, since it
// still makes etcd see that block as non-empty.

func (s *Snapshot) bad(kv *mvccpb.KeyValue, format string, args ...any) {
	s.Bad = append(s.Bad, BadKey{Key: string(kv.Key), Rev: kv.ModRevision, Error: fmt.Sprintf(format, args...)})
}

// badIP files an allocation key whose block is known but whose address or
// value is not: it still keeps that block from being empty.
func (s *Snapshot) badIP(kv *mvccpb.KeyValue, pool string, b netip.Prefix, format string, args ...any) {
	s.bad(kv, format, args...)
	s.Bad[len(s.Bad)-1].Pool, s.Bad[len(s.Bad)-1].Block = pool, b
}

// add files one key-value of the scanned tree by its key's kind, as
// etcdstore.ParseKey reads it.
func (s *Snapshot) add(kv *mvccpb.KeyValue) {
	k, err := etcdstore.ParseKey(string(kv.Key))
	if err != nil {
		if k.Kind == etcdstore.KeyIP && k.Block.IsValid() {
			s.badIP(kv, k.Pool, k.Block, "%v", err)
			return
		}
		s.bad(kv, "%v", err)
		return
	}
	if add := adders[k.Kind]; add != nil {
		add(s, kv, k)
	}
}

// adders file a parsed key-value by its kind.
var adders = map[etcdstore.KeyKind]func(*Snapshot, *mvccpb.KeyValue, etcdstore.Key){
	etcdstore.KeyPool: (*Snapshot).addPool, etcdstore.KeyNode: (*Snapshot).addNode,
	etcdstore.KeyClaim: (*Snapshot).addClaim, etcdstore.KeyHome: (*Snapshot).addHome,
	etcdstore.KeyLent: (*Snapshot).addLent, etcdstore.KeyIP: (*Snapshot).addIP,
	etcdstore.KeyBinding: (*Snapshot).addBinding, etcdstore.KeySchema: (*Snapshot).addSchema,
}

func (s *Snapshot) addSchema(kv *mvccpb.KeyValue, _ etcdstore.Key) {
	var set etcdstore.SchemaSetting
	if err := decode(kv, &set); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	set.Rev = kv.ModRevision
	s.Schema = set
}

func decode[T any](kv *mvccpb.KeyValue, v *T) error {
	if err := json.Unmarshal(kv.Value, v); err != nil {
		return fmt.Errorf("decode value: %w", err)
	}
	return nil
}

func (s *Snapshot) addPool(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var p allocator.Pool
	if err := decode(kv, &p); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if p.Name != k.Pool {
		s.bad(kv, "pool value names %q, key names %q", p.Name, k.Pool)
	} else if err := p.Validate(); err != nil {
		s.bad(kv, "%v", err)
	}
	// Keep even a flawed pool, so its blocks are not also reported as
	// records of a pool that does not exist.
	s.Pools[k.Pool] = Pool{Pool: p, Key: string(kv.Key), Rev: kv.ModRevision}
}

func (s *Snapshot) addNode(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var r etcdstore.NodeRecord
	if err := decode(kv, &r); err != nil {
		s.bad(kv, "%v", err)
		// A node record proves the node alive even if unreadable.
	}
	s.Nodes[k.Node] = Node{NodeRecord: r, Key: string(kv.Key), Rev: kv.ModRevision, KeyLease: kv.Lease}
}

func (s *Snapshot) addClaim(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var c records.Claim
	if err := decode(kv, &c); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if c.Node == "" {
		s.bad(kv, "claim names no node")
		return
	}
	s.Claims[BlockKey{Pool: k.Pool, Block: k.Block}] = ClaimRec{Claim: c, Pool: k.Pool, Block: k.Block, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease}
}

func (s *Snapshot) addHome(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var h records.Home
	if err := decode(kv, &h); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if h.Node == "" {
		s.bad(kv, "home names no node")
		return
	}
	s.Homes[BlockKey{Pool: k.Pool, Block: k.Block}] = HomeRec{Home: h, Pool: k.Pool, Block: k.Block, Key: string(kv.Key), Rev: kv.ModRevision}
}

// addLent reads the home of a borrowed address.
func (s *Snapshot) addLent(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var h records.Home
	if err := decode(kv, &h); err != nil || h.Node == "" {
		s.bad(kv, "lent address names no node")
		return
	}
	s.Lent[LentKey{Pool: k.Pool, Addr: k.Addr}] = LentRec{Node: h.Node, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease}
}

func (s *Snapshot) addIP(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var r records.Record
	if err := decode(kv, &r); err != nil {
		s.badIP(kv, k.Pool, k.Block, "%v", err)
		return
	}
	switch {
	case r.State == records.StateKept && r.Identity != "" && r.Node != "":
		// Kept for a sticky identity between its pods: no owner.
	case r.State != records.StateReserved && r.State != records.StateAllocated:
		s.badIP(kv, k.Pool, k.Block, "unknown state %q", r.State)
		return
	case r.ContainerID == "" || r.IfName == "" || r.Node == "":
		s.badIP(kv, k.Pool, k.Block, "allocation without containerID, ifName or node")
		return
	}
	s.IPs = append(s.IPs, IP{Record: r, Pool: k.Pool, Block: k.Block, Addr: k.Addr, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease})
}

// addBinding reads a sticky binding.
func (s *Snapshot) addBinding(kv *mvccpb.KeyValue, k etcdstore.Key) {
	var b records.Binding
	if err := decode(kv, &b); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	b.Pool, b.Rev, b.Lease = k.Pool, kv.ModRevision, kv.Lease
	s.Bindings = append(s.Bindings, BindingRec{Binding: b, Pool: k.Pool, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease})
}
