package inspect

import (
	"math/big"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// PoolUsage is the utilisation of one family of one pool.
//
// Address counts are big integers because an IPv6 pool can hold more than
// 2^64 addresses; they encode as exact JSON numbers.
type PoolUsage struct {
	Pool      string         `json:"pool"`
	Family    string         `json:"family"`
	CIDRs     []netip.Prefix `json:"cidrs"`
	BlockSize int            `json:"blockSize"`
	// Addresses is every address of the family's CIDRs (the capacity of
	// all blocks) less the network, broadcast and anycast addresses that
	// are never handed out.
	Addresses *big.Int `json:"addresses"`
	// Blocks is the number of blocks; Claimed hold a claim, Orphaned hold
	// allocations without a claim (orphaned or unowned blocks), and the
	// rest, FreeBlocks, can be claimed.
	Blocks     uint64 `json:"blocks"`
	Claimed    int    `json:"claimedBlocks"`
	Orphaned   int    `json:"orphanedBlocks"`
	FreeBlocks uint64 `json:"freeBlocks"`
	// Allocated and Reserved count distinct addresses by state (Reserved:
	// reservations of ADDs that have not finished); Borrowed those held by
	// a node in another node's block. ReservedRanges counts the addresses
	// in ranges an operator reserved. Free is Addresses less the
	// allocated, the reserved and the reserved ranges' unallocated ones.
	Allocated      int      `json:"allocated"`
	Reserved       int      `json:"reserved"`
	Borrowed       int      `json:"borrowed"`
	ReservedRanges uint64   `json:"reservedRanges"`
	Free           *big.Int `json:"free"`
	// Holders is how many addresses each node holds.
	Holders map[string]int `json:"holders,omitempty"`
	// Kept counts addresses kept for sticky identities between their
	// pods (not in Allocated); Bindings the pool's sticky identities.
	Kept     int `json:"kept"`
	Bindings int `json:"bindings"`
}

// Usage reports the utilisation of every family of one pool, or (pool "")
// of every pool, sorted by pool name and family. Records outside the
// pool's blocks (see Check) are not counted.
func Usage(s *Snapshot, pool string) []PoolUsage {
	var names []string
	for name := range s.Pools {
		if pool == "" || name == pool {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	views := s.blockViews()
	var out []PoolUsage
	for _, name := range names {
		p := s.Pools[name].Pool
		for _, f := range p.Families() {
			out = append(out, familyUsage(s, views, p, f))
		}
	}
	return out
}

func familyUsage(s *Snapshot, views []*blockView, p allocator.Pool, f allocator.Family) PoolUsage {
	u := PoolUsage{
		Pool: p.Name, Family: f.String(), CIDRs: p.CIDRsOf(f), BlockSize: p.BlockSize(f),
		Addresses: addressCount(p, f), Blocks: p.BlockCount(f),
	}
	for _, v := range views {
		if v.Pool != p.Name || allocator.FamilyOf(v.Block.Addr()) != f {
			continue
		}
		if _, ok := p.CIDRFor(v.Block); !ok {
			continue
		}
		switch v.state() {
		case BlockClaimed:
			u.Claimed++
		case BlockOrphaned, BlockUnowned:
			u.Orphaned++
		}
	}
	if taken := uint64(u.Claimed + u.Orphaned); taken < u.Blocks {
		u.FreeBlocks = u.Blocks - taken
	}
	seen := map[netip.Addr]bool{}
	inRanges := 0
	u.ReservedRanges = p.ReservedCount(f)
	for _, ip := range s.IPs {
		a := ip.Addr.Unmap()
		if ip.Pool != p.Name || allocator.FamilyOf(a) != f || !p.Contains(a) || seen[a] {
			continue
		}
		seen[a] = true
		switch ip.State {
		case records.StateReserved:
			u.Reserved++
		case records.StateKept:
			u.Kept++
		default:
			u.Allocated++
		}
		if ip.Borrowed {
			u.Borrowed++
		}
		if u.Holders == nil {
			u.Holders = map[string]int{}
		}
		u.Holders[ip.Node]++
		if _, ok := p.ReservationOf(a); ok {
			inRanges++
		}
	}
	for _, b := range s.Bindings {
		if b.Pool == p.Name && len(b.Addrs) > 0 && allocator.FamilyOf(b.Addrs[0]) == f {
			u.Bindings++
		}
	}
	held := int64(u.Allocated + u.Reserved + u.Kept - inRanges)
	u.Free = new(big.Int).Sub(u.Addresses, big.NewInt(held))
	u.Free.Sub(u.Free, new(big.Int).SetUint64(u.ReservedRanges))
	if u.Free.Sign() < 0 {
		u.Free.SetInt64(0)
	}
	return u
}

// addressCount is the number of addresses of family f that p can hand out:
// blocks times block size, less the excluded addresses, which sit only in
// the first and last block of each CIDR.
func addressCount(p allocator.Pool, f allocator.Family) *big.Int {
	bs := p.BlockSize(f)
	total := new(big.Int)
	for _, c := range p.CIDRsOf(f) {
		n := allocator.BlockCount(c, bs)
		if n == 0 {
			continue
		}
		first, err1 := allocator.BlockAt(c, bs, 0)
		last, err2 := allocator.BlockAt(c, bs, n-1)
		if err1 != nil || err2 != nil {
			continue
		}
		size := new(big.Int).SetUint64(n)
		size.Mul(size, big.NewInt(int64(allocator.BlockSize(first))))
		excluded := len(p.Excluded(first))
		if last != first {
			excluded += len(p.Excluded(last))
		}
		total.Add(total, size.Sub(size, big.NewInt(int64(excluded))))
	}
	return total
}
