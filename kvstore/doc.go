// Package kvstore is kvipam's thin layer over etcd: connecting from
// configuration, an embedded single-node etcd for a one-machine setup, the
// per-process lease session, small transaction and JSON helpers, a time
// limit for each etcd call (WithCallTimeout, calltimeout.go), transport
// failures mapped to ErrUnavailable (unavailable.go), and watches that
// survive compaction. It has no retry loop of its own (kvipam's one is
// internal/foundation/retry). Package kvstore/etcdtest starts a real etcd
// for tests.
//
// It knows nothing about IPAM; package allocator/etcdstore builds the key
// layout on top of it.
package kvstore
