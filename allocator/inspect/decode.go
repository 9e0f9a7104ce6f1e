package inspect

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"

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

// segments splits the key after prefix into exactly n non-empty segments.
func segments(kv *mvccpb.KeyValue, prefix string, n int) ([]string, bool) {
	rest, ok := strings.CutPrefix(string(kv.Key), prefix)
	if !ok {
		return nil, false
	}
	parts := strings.Split(rest, "/")
	if len(parts) != n {
		return nil, false
	}
	for _, p := range parts {
		if p == "" {
			return nil, false
		}
	}
	return parts, true
}

func decode[T any](kv *mvccpb.KeyValue, v *T) error {
	if err := json.Unmarshal(kv.Value, v); err != nil {
		return fmt.Errorf("decode value: %w", err)
	}
	return nil
}

func (s *Snapshot) addPool(kv *mvccpb.KeyValue) {
	seg, ok := segments(kv, poolsPrefix, 1)
	if !ok {
		s.bad(kv, "unexpected key: want %s<pool>", poolsPrefix)
		return
	}
	var p allocator.Pool
	if err := decode(kv, &p); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if p.Name != seg[0] {
		s.bad(kv, "pool value names %q, key names %q", p.Name, seg[0])
	} else if err := p.Validate(); err != nil {
		s.bad(kv, "%v", err)
	}
	// Keep even a flawed pool, so its blocks are not also reported as
	// records of a pool that does not exist.
	s.Pools[seg[0]] = Pool{Pool: p, Key: string(kv.Key), Rev: kv.ModRevision}
}

func (s *Snapshot) addNode(kv *mvccpb.KeyValue) {
	seg, ok := segments(kv, nodesPrefix, 1)
	if !ok {
		s.bad(kv, "unexpected key: want %s<node>", nodesPrefix)
		return
	}
	var r etcdstore.NodeRecord
	if err := decode(kv, &r); err != nil {
		s.bad(kv, "%v", err)
		// A node record proves the node alive even if unreadable.
	}
	s.Nodes[seg[0]] = Node{NodeRecord: r, Key: string(kv.Key), Rev: kv.ModRevision, KeyLease: kv.Lease}
}

// blockKey parses the <pool>/<block> part of a claim or home key.
func (s *Snapshot) blockKey(kv *mvccpb.KeyValue, prefix string) (BlockKey, bool) {
	seg, ok := segments(kv, prefix, 2)
	if !ok {
		s.bad(kv, "unexpected key: want %s<pool>/<block>", prefix)
		return BlockKey{}, false
	}
	b, err := allocator.ParseBlockName(seg[1])
	if err != nil {
		s.bad(kv, "%v", err)
		return BlockKey{}, false
	}
	return BlockKey{Pool: seg[0], Block: b}, true
}

func (s *Snapshot) addClaim(kv *mvccpb.KeyValue) {
	bk, ok := s.blockKey(kv, claimsPrefix)
	if !ok {
		return
	}
	var c records.Claim
	if err := decode(kv, &c); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if c.Node == "" {
		s.bad(kv, "claim names no node")
		return
	}
	s.Claims[bk] = ClaimRec{Claim: c, Pool: bk.Pool, Block: bk.Block, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease}
}

func (s *Snapshot) addHome(kv *mvccpb.KeyValue) {
	if seg, ok := segments(kv, homesPrefix, 3); ok && seg[1] == "ip" {
		s.addLent(kv, seg[0], seg[2])
		return
	}
	bk, ok := s.blockKey(kv, homesPrefix)
	if !ok {
		return
	}
	var h records.Home
	if err := decode(kv, &h); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	if h.Node == "" {
		s.bad(kv, "home names no node")
		return
	}
	s.Homes[bk] = HomeRec{Home: h, Pool: bk.Pool, Block: bk.Block, Key: string(kv.Key), Rev: kv.ModRevision}
}

// addLent reads the home of a borrowed address.
func (s *Snapshot) addLent(kv *mvccpb.KeyValue, pool, addr string) {
	a, err := netip.ParseAddr(addr)
	if err != nil {
		s.bad(kv, "lent address: %v", err)
		return
	}
	var h records.Home
	if err := decode(kv, &h); err != nil || h.Node == "" {
		s.bad(kv, "lent address names no node")
		return
	}
	s.Lent[LentKey{Pool: pool, Addr: a}] = LentRec{Node: h.Node, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease}
}

func (s *Snapshot) addIP(kv *mvccpb.KeyValue) {
	seg, ok := segments(kv, ipsPrefix, 3)
	if !ok {
		s.bad(kv, "unexpected key: want %s<pool>/<block>/<ip>", ipsPrefix)
		return
	}
	b, err := allocator.ParseBlockName(seg[1])
	if err != nil {
		s.bad(kv, "%v", err)
		return
	}
	a, err := netip.ParseAddr(seg[2])
	if err != nil {
		s.badIP(kv, seg[0], b, "parse address: %v", err)
		return
	}
	var r records.Record
	if err := decode(kv, &r); err != nil {
		s.badIP(kv, seg[0], b, "%v", err)
		return
	}
	switch {
	case r.State == records.StateKept && r.Identity != "" && r.Node != "":
		// Kept for a sticky identity between its pods: no owner.
	case r.State != records.StateReserved && r.State != records.StateAllocated:
		s.badIP(kv, seg[0], b, "unknown state %q", r.State)
		return
	case r.ContainerID == "" || r.IfName == "" || r.Node == "":
		s.badIP(kv, seg[0], b, "allocation without containerID, ifName or node")
		return
	}
	s.IPs = append(s.IPs, IP{Record: r, Pool: seg[0], Block: b, Addr: a, Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease})
}

// addBinding reads a sticky binding: <stickyPrefix><pool>/<namespace>/<name>.
func (s *Snapshot) addBinding(kv *mvccpb.KeyValue) {
	seg, ok := segments(kv, stickyPrefix, 3)
	if !ok {
		s.bad(kv, "unexpected key: want %s<pool>/<namespace>/<name>", stickyPrefix)
		return
	}
	var b records.Binding
	if err := decode(kv, &b); err != nil {
		s.bad(kv, "%v", err)
		return
	}
	b.Pool, b.Rev, b.Lease = seg[0], kv.ModRevision, kv.Lease
	s.Bindings = append(s.Bindings, BindingRec{Binding: b, Pool: seg[0], Key: string(kv.Key), Rev: kv.ModRevision, Lease: kv.Lease})
}
