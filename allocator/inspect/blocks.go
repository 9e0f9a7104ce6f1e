package inspect

import (
	"cmp"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// BlockState says whether a block can be claimed, and by whom.
type BlockState string

// A block is claimed while its node's lease lives. When the claim expires,
// a block still holding allocations is orphaned: only its home node may
// re-claim it, until an operator releases it (invariant 3). A block with
// no allocations is free whatever its stale home says.
const (
	BlockClaimed  BlockState = "claimed"
	BlockOrphaned BlockState = "orphaned"
	BlockFree     BlockState = "free"
	// BlockUnowned is a block with allocations but neither claim nor home:
	// no node can claim it, not even its former owner. Only a hand edit
	// produces it; kvipamctl release frees it.
	BlockUnowned BlockState = "unowned"
)

// blockView is everything the snapshot holds about one block.
type blockView struct {
	BlockKey
	claim *ClaimRec
	home  *HomeRec
	ips   []*IP     // allocations under the block's key prefix
	bad   []*BadKey // undecodable allocations under that prefix
}

func (v *blockView) state() BlockState {
	switch {
	case v.claim != nil:
		return BlockClaimed
	case len(v.ips)+len(v.bad) == 0:
		return BlockFree
	case v.home != nil:
		return BlockOrphaned
	default:
		return BlockUnowned
	}
}

// owner is the node a block belongs to: its claim's node, else its home's.
func (v *blockView) owner() string {
	switch {
	case v.claim != nil:
		return v.claim.Node
	case v.home != nil:
		return v.home.Node
	default:
		return ""
	}
}

// blockViews groups the snapshot by block, sorted by pool and address.
// A block appears if it has a claim, a home or allocation keys.
func (s *Snapshot) blockViews() []*blockView {
	m := map[BlockKey]*blockView{}
	get := func(k BlockKey) *blockView {
		v := m[k]
		if v == nil {
			v = &blockView{BlockKey: k}
			m[k] = v
		}
		return v
	}
	for k, c := range s.Claims {
		get(k).claim = &c
	}
	for k, h := range s.Homes {
		get(k).home = &h
	}
	for i := range s.IPs {
		ip := &s.IPs[i]
		v := get(BlockKey{Pool: ip.Pool, Block: ip.Block})
		v.ips = append(v.ips, ip)
	}
	for i := range s.Bad {
		if b := &s.Bad[i]; b.Block.IsValid() {
			v := get(BlockKey{Pool: b.Pool, Block: b.Block})
			v.bad = append(v.bad, b)
		}
	}
	out := make([]*blockView, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b *blockView) int {
		return cmp.Or(cmp.Compare(a.Pool, b.Pool), comparePrefix(a.Block, b.Block))
	})
	return out
}

func comparePrefix(a, b netip.Prefix) int {
	return cmp.Or(a.Addr().Compare(b.Addr()), cmp.Compare(a.Bits(), b.Bits()))
}

// BlockRow is one line of the block list.
type BlockRow struct {
	Pool  string       `json:"pool"`
	Block netip.Prefix `json:"block"`
	// Node is the claim's node, or the home's when unclaimed.
	Node       string     `json:"node,omitempty"`
	State      BlockState `json:"state"`
	Used       int        `json:"used"`
	Reserved   int        `json:"reserved"`
	Capacity   int        `json:"capacity"`
	ClaimLease int64      `json:"claimLease,omitempty"`
}

// Blocks lists every block that has a claim, a home or allocations, of one
// pool or (pool "") of all. Used counts confirmed allocations, Reserved
// reservations; Capacity is the block size less the addresses the pool
// never hands out.
func Blocks(s *Snapshot, pool string) []BlockRow {
	var out []BlockRow
	for _, v := range s.blockViews() {
		if pool != "" && v.Pool != pool {
			continue
		}
		r := BlockRow{Pool: v.Pool, Block: v.Block, Node: v.owner(), State: v.state(), Capacity: capacity(s, v.BlockKey)}
		if v.claim != nil {
			r.ClaimLease = v.claim.Lease
		}
		for _, ip := range v.ips {
			if ip.State == records.StateReserved {
				r.Reserved++
			} else {
				r.Used++
			}
		}
		out = append(out, r)
	}
	return out
}

// capacity is how many addresses of the block can be handed out.
func capacity(s *Snapshot, k BlockKey) int {
	n := allocator.BlockSize(k.Block)
	if p, ok := s.Pools[k.Pool]; ok {
		n -= len(p.Excluded(k.Block))
	}
	return n
}
