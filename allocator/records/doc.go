// Package records holds what kvipam stores in etcd and the contract of the
// store that holds it: owners, allocation records and their states, block
// claims and homes, sticky identities and their bindings, the writes the
// node allocator sends ([IPWrite]) and the [Store] interface that
// allocator/etcdstore implements, with the errors both sides share.
//
// It does no I/O and imports neither etcd nor the node allocator: etcdstore
// and inspect import it, and the node allocator (allocator/nodealloc) is one
// consumer of the Store among others. The pure arithmetic of pools and
// blocks is in package allocator.
package records
