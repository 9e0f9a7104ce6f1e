// Package kvstore is kvipam's thin layer over etcd: connecting from
// configuration, an embedded single-node etcd for a one-machine setup, the
// per-process lease session, small transaction and JSON helpers, one bounded
// retry helper, and watches that survive compaction.
//
// It knows nothing about IPAM; package allocator's etcd-backed store builds
// the key layout on top of it.
package kvstore
