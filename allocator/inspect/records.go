package inspect

import (
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// The records of a Snapshot: each one decoded value with the key it was read
// from and the revision that fences a later delete of it.

// BlockKey names one block of one pool.
type BlockKey struct {
	Pool  string
	Block netip.Prefix
}

// Snapshot is kvipam's state as read at one etcd revision. Maps are keyed by
// the name in the key, not in the value, since the key is what the
// allocator's transactions compare.
type Snapshot struct {
	Revision int64
	// Schema is the cluster's schema level (level 1 when etcd has none).
	Schema etcdstore.SchemaSetting
	Pools  map[string]Pool
	Nodes  map[string]Node
	Claims map[BlockKey]ClaimRec
	Homes  map[BlockKey]HomeRec
	// Lent are the homes of borrowed addresses, by pool and address.
	Lent map[LentKey]LentRec
	// Bindings are the sticky identities' bindings.
	Bindings []BindingRec
	// IPs are the allocations in key order.
	IPs []IP
	// Bad are keys under the kvipam prefix that could not be parsed or
	// decoded; they are reported by Check and otherwise ignored.
	Bad []BadKey
	// Scanned is the number of keys read.
	Scanned int
}

// LentKey names a borrowed address.
type LentKey struct {
	Pool string
	Addr netip.Addr
}

// LentRec is the home of a borrowed address: the node that holds it.
type LentRec struct {
	Node  string `json:"node"`
	Key   string `json:"key"`
	Rev   int64  `json:"rev"`
	Lease int64  `json:"lease,omitempty"`
}

// BindingRec is a sticky identity's binding as stored.
type BindingRec struct {
	records.Binding
	Pool  string `json:"pool"`
	Key   string `json:"key"`
	Rev   int64  `json:"rev"`
	Lease int64  `json:"lease,omitempty"`
}

// Pool is a pool record.
type Pool struct {
	allocator.Pool
	Key string `json:"key"`
	Rev int64  `json:"rev"`
}

// Node is a live node's record (it is on the node's lease).
type Node struct {
	etcdstore.NodeRecord
	Key      string `json:"key"`
	Rev      int64  `json:"rev"`
	KeyLease int64  `json:"keyLease,omitempty"`
}

// ClaimRec is a node's claim on a block.
type ClaimRec struct {
	records.Claim
	Pool  string       `json:"pool"`
	Block netip.Prefix `json:"block"`
	Key   string       `json:"key"`
	Rev   int64        `json:"rev"`
	Lease int64        `json:"lease,omitempty"`
}

// HomeRec is the record of which node a block belongs to.
type HomeRec struct {
	records.Home
	Pool  string       `json:"pool"`
	Block netip.Prefix `json:"block"`
	Key   string       `json:"key"`
	Rev   int64        `json:"rev"`
}

// IP is one allocation. Block is the block named in the key, which is what
// decides whether etcd sees the block as empty; it normally holds Addr.
type IP struct {
	records.Record
	Pool  string       `json:"pool"`
	Block netip.Prefix `json:"block"`
	Addr  netip.Addr   `json:"ip"`
	Key   string       `json:"key"`
	Rev   int64        `json:"rev"`
	Lease int64        `json:"lease,omitempty"`
}

// BadKey is a key that could not be understood. Pool and Block are set for
// an allocation key whose block could be read from the key: such a key
// still keeps its block from being empty.
type BadKey struct {
	Key   string       `json:"key"`
	Rev   int64        `json:"rev"`
	Error string       `json:"error"`
	Pool  string       `json:"pool,omitempty"`
	Block netip.Prefix `json:"block,omitzero"`
}
