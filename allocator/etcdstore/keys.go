package etcdstore

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/kvipam/kvipam/allocator"
)

// Prefix is the root of every kvipam key. The version in it changes only
// with an incompatible schema; docs/etcd-schema.md describes each key.
const Prefix = "/kvipam/v1/"

// The key builders below are the only place a key is spelled. Each kind of
// record has its own subtree so that one range read lists it, and
// allocations sit under their block so that one range compare asks "is
// this block empty".

// PoolKey is a pool's spec; no lease.
func PoolKey(pool string) string { return PoolsPrefix() + pool }

// PoolsPrefix lists every pool.
func PoolsPrefix() string { return Prefix + "pools/" }

// DeletedPoolKey marks a pool an operator deleted (kvipamctl pool
// delete); no lease. An agent's configuration does not seed a pool of
// that name again (SeedPool); pool create removes the mark.
func DeletedPoolKey(pool string) string { return deletedPoolsPrefix() + pool }

// deletedPoolsPrefix lists every deleted pool's mark.
func deletedPoolsPrefix() string { return Prefix + "deleted-pools/" }

// historySettingKey is the IP-history retention the agents run with
// (HistorySetting); no lease.
func historySettingKey() string { return Prefix + "settings/history" }

// NodeKey is the node record, on the node's lease.
func NodeKey(node string) string { return nodesPrefix() + node }

// nodesPrefix lists every live node.
func nodesPrefix() string { return Prefix + "nodes/" }

// AllClaimsPrefix lists every pool's claims.
func AllClaimsPrefix() string { return Prefix + "claims/" }

// AllHomesPrefix lists every pool's block homes.
func AllHomesPrefix() string { return Prefix + "homes/" }

// AllIPsPrefix lists every pool's allocations.
func AllIPsPrefix() string { return Prefix + "ips/" }

// HealthKey is the key agents read to check that etcd answers. Nothing
// writes it; reading it needs only the role on the kvipam prefix.
func HealthKey() string { return Prefix + "health" }

// ClaimsPrefix lists a pool's claims.
func ClaimsPrefix(pool string) string { return AllClaimsPrefix() + pool + "/" }

// ClaimKey is a node's claim on a block, on the node's lease.
func ClaimKey(pool string, b netip.Prefix) string {
	return ClaimsPrefix(pool) + allocator.BlockName(b)
}

// HomesPrefix lists a pool's block homes.
func HomesPrefix(pool string) string { return AllHomesPrefix() + pool + "/" }

// HomeKey records which node a block belongs to; no lease.
func HomeKey(pool string, b netip.Prefix) string {
	return HomesPrefix(pool) + allocator.BlockName(b)
}

// LentPrefix lists the homes of a pool's lent addresses: addresses a node
// holds in another node's block (borrowed). They sit under the pool's
// homes, which every agent watches to route, one level deeper than the
// block homes so that nothing reads one for the other.
func LentPrefix(pool string) string { return HomesPrefix(pool) + "ip/" }

// LentKey is the home of one lent address: the node holding it. It has
// the allocation's lease (a reservation's) or none, and goes with it.
func LentKey(pool string, a netip.Addr) string { return LentPrefix(pool) + a.String() }

// borrowerKey is a node's borrow fence, on the node's lease: borrowed
// writes compare its revision, as block writes compare their claim's.
func borrowerKey(node string) string { return Prefix + "borrowers/" + node }

// allStickyPrefix lists every pool's sticky bindings.
func allStickyPrefix() string { return Prefix + "sticky/" }

// StickyPrefix lists a pool's sticky bindings.
func StickyPrefix(pool string) string { return allStickyPrefix() + pool + "/" }

// BindingKey is a sticky identity's binding: which addresses it holds
// and who holds them now. No lease while a pod holds them; the kept
// records' lease while none does.
func BindingKey(pool, identity string) string { return StickyPrefix(pool) + identity }

// IPsPrefix lists every allocation of a pool.
func IPsPrefix(pool string) string { return AllIPsPrefix() + pool + "/" }

// BlockIPsPrefix lists the allocations of one block. The trailing slash
// keeps 10.0.0.0-26 from matching 10.0.0.0-260-like siblings.
func BlockIPsPrefix(pool string, b netip.Prefix) string {
	return IPsPrefix(pool) + allocator.BlockName(b) + "/"
}

// IPKey is one allocation.
func IPKey(pool string, b netip.Prefix, a netip.Addr) string {
	return BlockIPsPrefix(pool, b) + a.String()
}

// lastSegment returns the part of key after prefix, refusing nested paths.
func lastSegment(key, prefix string) (string, error) {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || rest == "" || strings.Contains(rest, "/") {
		return "", fmt.Errorf("unexpected key %q under %q", key, prefix)
	}
	return rest, nil
}

// parseIPKey splits an allocation key of pool into block and address.
func parseIPKey(pool, key string) (netip.Prefix, netip.Addr, error) {
	rest, ok := strings.CutPrefix(key, IPsPrefix(pool))
	if !ok {
		return netip.Prefix{}, netip.Addr{}, fmt.Errorf("key %q is not an allocation of pool %s", key, pool)
	}
	bname, aname, ok := strings.Cut(rest, "/")
	if !ok {
		return netip.Prefix{}, netip.Addr{}, fmt.Errorf("allocation key %q has no address", key)
	}
	b, err := allocator.ParseBlockName(bname)
	if err != nil {
		return netip.Prefix{}, netip.Addr{}, fmt.Errorf("allocation key %q: %w", key, err)
	}
	a, err := netip.ParseAddr(aname)
	if err != nil || !b.Contains(a) {
		return netip.Prefix{}, netip.Addr{}, fmt.Errorf("allocation key %q: address %q not in block %s", key, aname, b)
	}
	return b, a, nil
}

// namespaceBindingsPrefix lists every namespace's default pool.
func namespaceBindingsPrefix() string { return Prefix + "nsbindings/" }

// namespaceBindingKey is namespace ns's default pool.
func namespaceBindingKey(ns string) string { return namespaceBindingsPrefix() + ns }
