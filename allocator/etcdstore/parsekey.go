package etcdstore

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/kvipam/kvipam/allocator"
)

// KeyKind is the kind of record a key holds, by the subtree it is in.
type KeyKind string

// Kinds of record keys, as ParseKey reads them.
const (
	KeyPool    KeyKind = "pool"    // PoolKey
	KeyNode    KeyKind = "node"    // NodeKey
	KeyClaim   KeyKind = "claim"   // ClaimKey
	KeyHome    KeyKind = "home"    // HomeKey
	KeyLent    KeyKind = "lent"    // LentKey
	KeyIP      KeyKind = "ip"      // IPKey
	KeyBinding KeyKind = "binding" // BindingKey
	// KeyDeletedPool is DeletedPoolKey.
	KeyDeletedPool KeyKind = "deleted-pool"
	// KeySchema is the cluster's schema level (SchemaSetting).
	KeySchema KeyKind = "schema"
)

// Key is a record key read back into the names that built it. Which
// fields are set depends on Kind: Pool for every kind but KeyNode; Node
// for KeyNode; Block for claims, homes and allocations; Addr for
// allocations and lent addresses; Identity ("namespace/name") for
// bindings.
type Key struct {
	Kind     KeyKind
	Pool     string
	Node     string
	Block    netip.Prefix
	Addr     netip.Addr
	Identity string
}

// ParseKey reads a record key: the inverse of the key builders, for the
// record kinds a reader of the whole tree meets (pools, deleted pools'
// marks, nodes, claims, homes, lent addresses, allocations, bindings).
//
// It is lenient where the allocator is strict, for an operator's view of
// what etcd holds: an allocation whose address is not in its key's block
// is read as it is (parseIPKey refuses it), since it still makes etcd see
// that block as non-empty.
//
// A key under a kind's subtree that does not have that kind's shape
// returns an error saying what was expected, with Kind set and every
// field read before the part that failed: an allocation key whose block
// parsed but whose address did not keeps Pool and Block, because such a
// key still keeps its block from being empty. A key under no kind's
// subtree returns an error and a zero Key.
func ParseKey(key string) (Key, error) {
	if key == SchemaKey() {
		return Key{Kind: KeySchema}, nil
	}
	for _, k := range []struct {
		prefix string
		parse  func(rest string) (Key, error)
	}{
		{PoolsPrefix(), func(rest string) (Key, error) { return parseName(KeyPool, rest, PoolsPrefix()+"<pool>") }},
		{nodesPrefix(), func(rest string) (Key, error) { return parseName(KeyNode, rest, nodesPrefix()+"<node>") }},
		{deletedPoolsPrefix(), func(rest string) (Key, error) {
			return parseName(KeyDeletedPool, rest, deletedPoolsPrefix()+"<pool>")
		}},
		{AllClaimsPrefix(), func(rest string) (Key, error) { return parseBlockKey(KeyClaim, rest, AllClaimsPrefix()) }},
		{AllHomesPrefix(), parseHome},
		{AllIPsPrefix(), parseIP},
		{allStickyPrefix(), parseBinding},
	} {
		if rest, ok := strings.CutPrefix(key, k.prefix); ok {
			return k.parse(rest)
		}
	}
	return Key{}, fmt.Errorf("unexpected key %q: not a record of %s", key, Prefix)
}

// segments splits rest into exactly n non-empty segments.
func segments(rest string, n int) ([]string, bool) {
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

// parseName reads a pool's or a node's key: one name.
func parseName(kind KeyKind, rest, want string) (Key, error) {
	seg, ok := segments(rest, 1)
	if !ok {
		return Key{Kind: kind}, fmt.Errorf("unexpected key: want %s", want)
	}
	if kind == KeyNode {
		return Key{Kind: kind, Node: seg[0]}, nil
	}
	return Key{Kind: kind, Pool: seg[0]}, nil
}

// parseBlockKey reads the <pool>/<block> of a claim or home key.
func parseBlockKey(kind KeyKind, rest, prefix string) (Key, error) {
	seg, ok := segments(rest, 2)
	if !ok {
		return Key{Kind: kind}, fmt.Errorf("unexpected key: want %s<pool>/<block>", prefix)
	}
	k := Key{Kind: kind, Pool: seg[0]}
	b, err := allocator.ParseBlockName(seg[1])
	if err != nil {
		return k, err
	}
	k.Block = b
	return k, nil
}

// parseHome reads a block's home, <pool>/<block>, or a lent address's,
// <pool>/ip/<addr>.
func parseHome(rest string) (Key, error) {
	if seg, ok := segments(rest, 3); ok && seg[1] == "ip" {
		k := Key{Kind: KeyLent, Pool: seg[0]}
		a, err := netip.ParseAddr(seg[2])
		if err != nil {
			return k, fmt.Errorf("lent address: %w", err)
		}
		k.Addr = a
		return k, nil
	}
	return parseBlockKey(KeyHome, rest, AllHomesPrefix())
}

// parseIP reads an allocation's <pool>/<block>/<addr>.
func parseIP(rest string) (Key, error) {
	seg, ok := segments(rest, 3)
	if !ok {
		return Key{Kind: KeyIP}, fmt.Errorf("unexpected key: want %s<pool>/<block>/<ip>", AllIPsPrefix())
	}
	k := Key{Kind: KeyIP}
	b, err := allocator.ParseBlockName(seg[1])
	if err != nil {
		return k, err
	}
	k.Pool, k.Block = seg[0], b
	a, err := netip.ParseAddr(seg[2])
	if err != nil {
		return k, fmt.Errorf("parse address: %w", err)
	}
	k.Addr = a
	return k, nil
}

// parseBinding reads a sticky binding's <pool>/<namespace>/<name>.
func parseBinding(rest string) (Key, error) {
	seg, ok := segments(rest, 3)
	if !ok {
		return Key{Kind: KeyBinding}, fmt.Errorf("unexpected key: want %s<pool>/<namespace>/<name>", allStickyPrefix())
	}
	return Key{Kind: KeyBinding, Pool: seg[0], Identity: seg[1] + "/" + seg[2]}, nil
}
