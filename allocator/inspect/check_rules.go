package inspect

import (
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
)

// The rules of CheckSnapshot, one method per group of records.

func (c *checker) badKeys() {
	for _, b := range c.s.Bad {
		c.add(KindUndecodable, []string{b.Key}, "%s", b.Error)
	}
}

// pool returns the pool a record names, reporting it if there is none.
func (c *checker) pool(name, key, what string) (allocator.Pool, bool) {
	p, ok := c.s.Pools[name]
	if !ok {
		c.add(KindUnknownPool, []string{key}, "%s of pool %q, which does not exist", what, name)
	}
	return p.Pool, ok
}

func (c *checker) claimsAndHomes() {
	for k, cl := range c.s.Claims {
		p, ok := c.pool(k.Pool, cl.Key, "claim")
		if ok {
			if _, ok := p.CIDRFor(k.Block); !ok {
				c.add(KindMisplaced, []string{cl.Key}, "claim on %s, which is not a block of pool %s", k.Block, k.Pool)
			}
		}
		if _, alive := c.s.Nodes[cl.Node]; !alive {
			c.add(KindDeadNodeClaim, []string{cl.Key, etcdstore.NodeKey(cl.Node)},
				"block %s of pool %s is claimed by node %s, which has no node record", k.Block, k.Pool, cl.Node)
		}
		if cl.Lease == 0 {
			c.add(KindClaimWithoutLease, []string{cl.Key}, "claim of node %s on block %s has no lease and never expires", cl.Node, k.Block)
		}
		if h, ok := c.s.Homes[k]; ok && h.Node != cl.Node {
			c.add(KindWrongNode, []string{cl.Key, h.Key}, "block %s of pool %s is claimed by node %s but its home is node %s", k.Block, k.Pool, cl.Node, h.Node)
		}
	}
	for k, h := range c.s.Homes {
		if p, ok := c.pool(k.Pool, h.Key, "home"); ok {
			if _, ok := p.CIDRFor(k.Block); !ok {
				c.add(KindMisplaced, []string{h.Key}, "home of %s, which is not a block of pool %s", k.Block, k.Pool)
			}
		}
	}
	borrowed := map[LentKey]string{}
	for _, ip := range c.s.IPs {
		if ip.Borrowed {
			borrowed[LentKey{Pool: ip.Pool, Addr: ip.Addr}] = ip.Node
		}
	}
	for k, l := range c.s.Lent {
		if node, ok := borrowed[k]; !ok || node != l.Node {
			c.add(KindWrongNode, []string{l.Key}, "home of lent address %s names node %s, but no borrowed allocation of that node holds it: peers route it there", k.Addr, l.Node)
		}
	}
}

func (c *checker) blocks() {
	for _, v := range c.s.blockViews() {
		n := len(v.ips) + len(v.bad)
		switch v.state() {
		case BlockOrphaned:
			c.add(KindOrphanedBlock, []string{v.home.Key},
				"block %s of pool %s holds %d allocations, has no claim, home node %s: only that node may re-claim it (or kvipamctl node remove %s)",
				v.Block, v.Pool, n, v.home.Node, v.home.Node)
		case BlockUnowned:
			c.add(KindOrphanedBlock, []string{etcdstore.BlockIPsPrefix(v.Pool, v.Block)},
				"block %s of pool %s holds %d allocations and has neither claim nor home: no node can claim it (kvipamctl release its addresses)",
				v.Block, v.Pool, n)
		}
	}
}

func (c *checker) ips() {
	views := map[BlockKey]*blockView{}
	for _, v := range c.s.blockViews() {
		views[v.BlockKey] = v
	}
	for _, ip := range c.s.IPs {
		keys := []string{ip.Key}
		if p, ok := c.pool(ip.Pool, ip.Key, "allocation"); ok {
			c.placement(p, ip)
		}
		lent, isLent := c.s.Lent[LentKey{Pool: ip.Pool, Addr: ip.Addr}]
		switch v := views[BlockKey{Pool: ip.Pool, Block: ip.Block}]; {
		case ip.Borrowed && (!isLent || lent.Node != ip.Node):
			c.add(KindWrongNode, keys, "%s is borrowed by node %s but its home names %q: peers do not route it there", ip.Addr, ip.Node, lent.Node)
		case ip.Borrowed && v.home == nil:
			c.add(KindWrongNode, keys, "%s of node %s is borrowed from block %s, which has no home", ip.Addr, ip.Node, ip.Block)
		case ip.Borrowed:
			// In another node's block, routed by its own home.
		case v.claim != nil && v.claim.Node != ip.Node:
			c.add(KindWrongNode, append(keys, v.claim.Key), "%s of node %s is in block %s claimed by node %s", ip.Addr, ip.Node, ip.Block, v.claim.Node)
		case v.claim == nil && v.home != nil && v.home.Node != ip.Node:
			c.add(KindWrongNode, append(keys, v.home.Key), "%s of node %s is in block %s whose home is node %s", ip.Addr, ip.Node, ip.Block, v.home.Node)
		case v.claim == nil && v.home == nil:
			c.add(KindWrongNode, keys, "%s of node %s is in block %s, which has neither claim nor home", ip.Addr, ip.Node, ip.Block)
		}
		switch {
		case ip.State == records.StateReserved && ip.Lease == 0:
			c.add(KindExpiredReservation, keys, "reservation of %s for %s has no lease and never expires", ip.Addr, ip.Owner.Key())
		case ip.State == records.StateReserved:
			if ttl, ok := c.ttls[ip.Lease]; ok && ttl <= 0 {
				c.add(KindExpiredReservation, keys, "reservation of %s for %s is on lease %x, which has expired", ip.Addr, ip.Owner.Key(), ip.Lease)
			}
		case ip.Lease != 0 && ip.State != records.StateKept:
			c.add(KindLeasedAllocation, keys, "allocation of %s for %s is on lease %x and will vanish with it", ip.Addr, ip.Owner.Key(), ip.Lease)
		}
	}
}

// placement checks that an allocation's key names a block of its pool
// holding its address, spelled as the allocator spells it.
func (c *checker) placement(p allocator.Pool, ip IP) {
	keys := []string{ip.Key}
	switch {
	case !strings.HasSuffix(ip.Key, "/"+ip.Addr.String()):
		c.add(KindMisplaced, keys, "address is not written in canonical form %s", ip.Addr)
	case !ip.Block.Contains(ip.Addr):
		c.add(KindMisplaced, keys, "address %s is outside the key's block %s", ip.Addr, ip.Block)
	}
	if _, ok := p.CIDRFor(ip.Block); !ok {
		c.add(KindMisplaced, keys, "%s is not a block of pool %s", ip.Block, p.Name)
	} else if slices.Contains(p.Excluded(ip.Block), ip.Addr) {
		c.add(KindMisplaced, keys, "%s is a network, broadcast or anycast address the pool never hands out", ip.Addr)
	}
}

// duplicates finds addresses with two keys and owners with two addresses.
func (c *checker) duplicates() {
	type addrKey struct {
		pool string
		addr netip.Addr
	}
	type ownerKey struct {
		pool, owner string
		family      allocator.Family
	}
	byAddr := map[addrKey][]IP{}
	byOwner := map[ownerKey][]IP{}
	var addrOrder []addrKey
	var ownerOrder []ownerKey
	for _, ip := range c.s.IPs {
		a := addrKey{ip.Pool, ip.Addr.Unmap()}
		if byAddr[a] == nil {
			addrOrder = append(addrOrder, a)
		}
		byAddr[a] = append(byAddr[a], ip)
		o := ownerKey{ip.Pool, ip.Owner.Key(), allocator.FamilyOf(ip.Addr)}
		if ip.State == records.StateKept {
			o.owner = "kept for " + ip.Identity
		}
		if byOwner[o] == nil {
			ownerOrder = append(ownerOrder, o)
		}
		byOwner[o] = append(byOwner[o], ip)
	}
	for _, a := range addrOrder {
		if ips := byAddr[a]; len(ips) > 1 {
			c.add(KindDuplicateIP, keysOf(ips), "%s of pool %s is held under %d keys, by %s", a.addr, a.pool, len(ips), describe(ips, func(ip IP) string { return ip.Owner.Key() + " on " + ip.Node }))
		}
	}
	for _, o := range ownerOrder {
		// The same address twice is a duplicate-ip, not a second address.
		if ips := byOwner[o]; distinctAddrs(ips) > 1 {
			c.add(KindDuplicateOwner, keysOf(ips), "%s holds %d %s addresses in pool %s: %s", o.owner, len(ips), o.family, o.pool, describe(ips, func(ip IP) string { return ip.Addr.String() }))
		}
	}
}

func keysOf(ips []IP) []string {
	out := make([]string, len(ips))
	for i, ip := range ips {
		out[i] = ip.Key
	}
	return out
}

func describe(ips []IP, f func(IP) string) string {
	parts := make([]string, len(ips))
	for i, ip := range ips {
		parts[i] = f(ip)
	}
	return strings.Join(parts, ", ")
}

func distinctAddrs(ips []IP) int {
	seen := map[netip.Addr]bool{}
	for _, ip := range ips {
		seen[ip.Addr.Unmap()] = true
	}
	return len(seen)
}

// lostEndpoints reports every endpoint a live node listed in its node
// record as lost, with the keys of the allocations that hold its
// addresses now.
func (c *checker) lostEndpoints() {
	held := map[netip.Addr][]string{}
	for _, ip := range c.s.IPs {
		held[ip.Addr.Unmap()] = append(held[ip.Addr.Unmap()], ip.Key)
	}
	for name, n := range c.s.Nodes {
		for _, le := range n.LostEndpoints {
			keys := []string{n.Key}
			parts := make([]string, 0, len(le.IPs))
			for _, ip := range le.IPs {
				parts = append(parts, ip.IP+" held by "+ip.Holder())
				if a, err := netip.ParseAddr(ip.IP); err == nil {
					keys = append(keys, held[a.Unmap()]...)
				}
			}
			pod := ""
			if le.Pod != "" {
				pod = " (pod " + le.Namespace + "/" + le.Pod + ")"
			}
			if le.Reason != "" {
				c.add(KindLostEndpoint, keys, "node %s could not re-assert the allocation of endpoint %s%s that etcd had lost (%s): %s; delete the pod, it must not keep using them",
					name, le.Owner, pod, le.Reason, strings.Join(parts, ", "))
				continue
			}
			c.add(KindLostEndpoint, keys, "node %s came back to find endpoint %s%s without its addresses: %s; delete the pod, it must not keep using them",
				name, le.Owner, pod, strings.Join(parts, ", "))
		}
	}
}

// bindings checks each sticky binding against the allocations: every
// address it names is held for its identity, by its pod or kept.
func (c *checker) bindings() {
	held := map[LentKey]IP{}
	for _, ip := range c.s.IPs {
		held[LentKey{Pool: ip.Pool, Addr: ip.Addr}] = ip
	}
	for _, b := range c.s.Bindings {
		for _, addr := range b.Addrs {
			ip, ok := held[LentKey{Pool: b.Pool, Addr: addr}]
			switch {
			case !ok:
				c.add(KindStickyConflict, []string{b.Key}, "sticky identity %s names %s, which no allocation holds", b.Identity, addr)
			case ip.Identity != b.Identity:
				c.add(KindStickyConflict, []string{b.Key, ip.Key}, "sticky identity %s names %s, which %s holds on node %s", b.Identity, addr, ip.Owner.Key(), ip.Node)
			case !b.Kept() && ip.State != records.StateKept && ip.Owner.Key() != b.Owner.Key():
				c.add(KindStickyConflict, []string{b.Key, ip.Key}, "sticky identity %s is held by %s, but %s is %s's", b.Identity, b.Owner.Key(), addr, ip.Owner.Key())
			}
		}
	}
}

// schemaLevel reports live nodes below the cluster's schema level, and
// pools that need a level above it.
func (c *checker) schemaLevel() {
	level := max(c.s.Schema.Level, schema.Base)
	for _, name := range slices.Sorted(maps.Keys(c.s.Nodes)) {
		n := c.s.Nodes[name]
		if l := etcdstore.NodeLevel(n.NodeRecord); l < level {
			v := n.Version
			if v == "" {
				v = "an unknown version"
			}
			c.add(KindBelowSchema, []string{n.Key}, "node %s runs %s, which understands schema level %d, below the cluster's %d: it may misread or drop %s; upgrade it, or lower the level first (kvipamctl downgrade)",
				name, v, l, level, strings.Join(schema.FeaturesAbove(l), ", "))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(c.s.Pools)) {
		p := c.s.Pools[name]
		if need := schema.PoolNeeds(p.Pool); need > level {
			c.add(KindBelowSchema, []string{p.Key}, "pool %s needs schema level %d, above the cluster's %d (written around the gate?): nodes may ignore its settings", name, need, level)
		}
	}
}
