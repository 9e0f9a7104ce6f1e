// Package nodealloc is the node allocator: it hands out addresses from the
// blocks one node owns, claims blocks from the shared pool as it needs
// them, borrows single addresses from other nodes' blocks when it can claim
// none, keeps sticky identities' addresses between their pods, and settles
// every store call whose outcome is unknown by reading it back.
//
// etcd, through a [records.Store], is the source of truth; the node
// allocator's memory is a cache of it, rebuilt by [Allocator.Restore] and
// corrected whenever a write or a read-back finds it wrong. The cache and
// every decision on it are package planner, which does no I/O; the
// Allocator is its driver (locks, store calls, retries, settling). The arithmetic
// it relies on (pools, blocks, bitmaps, the block walk) is the pure package
// allocator; the records and the Store contract are package records.
//
// Only the agent, the demo and test helpers import it.
package nodealloc
