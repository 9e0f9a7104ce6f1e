// Package inspect gives operators read-only views of kvipam's etcd state
// and the few audited repairs an operator may make: releasing addresses and
// removing a dead node's blocks. It is the library behind kvipamctl.
//
// # Reading
//
// [Inspector.Snapshot] reads the whole /kvipam/v1/ tree through
// etcdstore.Operator.ScanAll with range reads, one per record kind (pools,
// nodes, claims, homes, ips, sticky bindings), all at the
// revision of the first, so every view describes one instant. It never reads
// one key per address: a cluster of 150,000 allocations is one range read.
// Keys that cannot be parsed or decoded are kept aside in the snapshot, so a
// single bad value written by hand does not hide the rest.
//
// Views over a snapshot ([Usage], [Blocks], [IPs], [CheckSnapshot]) are pure
// functions returning plain structs with JSON tags, for tables and scripts.
//
// # Checking
//
// [Inspector.Check] looks for breaches of kvipam's invariants (docs/design.md):
// an address with two owners, an allocation outside its node's blocks,
// orphaned blocks, claims of nodes that are gone, reservations that outlived
// their lease, records of pools that do not exist, and undecodable values. A
// store written only by kvipam agents has no findings.
//
// # Repairing
//
// Repairs are planned first ([PlanReleaseIP], [PlanReleaseOwner],
// [PlanReleaseNode], [PlanNodeRemove]) from a snapshot, which lists every key
// to delete with the revision it was seen at; [Inspector.Execute] then
// deletes each key only if it still has that revision, and only if the
// step's guards still hold (for example "the node record is still absent",
// "the block is still unclaimed"). A node that comes back between plan and
// execution therefore keeps its addresses: the deletes fail instead. Deletes
// are idempotent, so a plan can be executed again after a partial failure.
//
// Removing a node, or releasing addresses of a node that has no node
// record, also takes the operator's [Evidence] that it is gone: a missing
// node record is not proof, since a node cut off from etcd for longer than
// its lease TTL loses it too while its pods run on. The planners refuse
// evidence that etcd contradicts (a record the node wrote after the stated
// last-seen time), with an [EvidenceError] naming the node.
//
// Inspector is safe for concurrent use; snapshots and plans are values that
// are not modified after they are built.
package inspect
