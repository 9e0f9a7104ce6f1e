// Package allocator holds the pure arithmetic of kvipam: pools, blocks, block
// names, and the in-memory free map of a block a node owns.
//
// Nothing here does I/O or imports etcd. The etcd-backed allocator decides
// what to claim and what to write; this package only answers questions such
// as "which block holds this address", "what is the i-th block of this CIDR",
// "which address should the next pod get". Keeping it pure lets those answers
// be tested exhaustively and fuzzed without a datastore, as host-local and
// Calico do with their allocators.
//
// # Pools and blocks
//
// A [Pool] is a named set of CIDRs with one block size per address family. A
// block is one block-size prefix of a pool CIDR; nodes claim whole blocks and
// hand out addresses from them. Blocks are kept as bitmaps, so a block holds
// at most 65536 addresses (/16 for IPv4, /112 for IPv6). Block indices within
// one CIDR are bounded by 2^62, which still allows an IPv6 /64 with /120
// blocks (2^56 blocks). Index arithmetic on IPv6 is exact 128-bit arithmetic.
//
// [BlockName] writes a block so it can sit in an etcd key ("10.0.1.0-26",
// "fd00--100-120") and [ParseBlockName] reads it back exactly.
//
// # Network, broadcast and anycast addresses
//
// Pod addresses are routed as /32 and /128 host routes, so the boundaries of a
// block mean nothing on the wire and every address of a block is usable,
// except at the edges of each pool CIDR, where a host on a directly attached
// subnet of that CIDR could still read them as special:
//
//   - IPv4 CIDR of prefix /30 or shorter: the first (network) and last
//     (broadcast) address are never handed out.
//   - IPv4 /31 and /32: every address is usable (RFC 3021 point-to-point).
//   - IPv6 CIDR of prefix /126 or shorter: the first address, the
//     subnet-router anycast address of RFC 4291, is never handed out.
//   - IPv6 /127 and /128: every address is usable (RFC 6164).
//
// These excluded addresses therefore fall only in the first and last block of
// a CIDR; [Pool.Excluded] lists them for a block and [NewBlockAlloc] marks
// them used forever. With host-sized blocks (/32 in an IPv4 /30 or shorter,
// /128 in an IPv6 /126 or shorter) such an edge block has no usable address
// at all; [BlockAlloc.Capacity] is then 0.
//
// # Concurrency
//
// Pool and the block functions are values and pure functions, safe to use
// from any goroutine. [Bitmap] and [BlockAlloc] are mutable and not safe for
// concurrent use; their owner serializes access.
package allocator
