package etcdstore

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator/records"
)

// CIDRUse is what is left in a part of a pool: blocks claimed, blocks
// with a home, addresses with a record (allocated, reserved for an
// unfinished ADD, or kept for a sticky identity), and the nodes holding
// them. It is what remove-cidr and pool delete wait for, and how a
// drain's progress is shown.
type CIDRUse struct {
	Claimed   int      `json:"blocksClaimed"`
	Homes     int      `json:"blocksWithHome"`
	Addresses int      `json:"addressesInUse"`
	Nodes     []string `json:"nodes,omitempty"`
}

// Any reports whether anything is left.
func (u CIDRUse) Any() bool { return u.Claimed+u.Homes+u.Addresses > 0 }

// String describes u for an operator.
func (u CIDRUse) String() string {
	nodes := strings.Join(u.Nodes, ", ")
	if nodes == "" {
		nodes = "none"
	}
	return fmt.Sprintf("%d addresses allocated, %d blocks claimed, %d blocks with a home, by nodes %s", u.Addresses, u.Claimed, u.Homes, nodes)
}

// CIDRUse reads what is left in cidr of a pool, at one revision.
func (s *Store) CIDRUse(ctx context.Context, pool string, cidr netip.Prefix) (CIDRUse, error) {
	snap, err := s.PoolSnapshot(ctx, pool)
	if err != nil {
		return CIDRUse{}, err
	}
	return useOf(snap, cidr), nil
}

// useOf is what snap holds in cidr.
func useOf(snap records.PoolSnapshot, cidr netip.Prefix) CIDRUse {
	return useWhere(snap, func(b netip.Prefix) bool { return cidr.Overlaps(b) })
}

// useWhere is what snap holds in the blocks that match.
func useWhere(snap records.PoolSnapshot, match func(netip.Prefix) bool) CIDRUse {
	var u CIDRUse
	nodes := map[string]bool{}
	for _, bi := range snap.Blocks {
		if !match(bi.Block) {
			continue
		}
		if bi.Claim != nil {
			u.Claimed++
			nodes[bi.Claim.Node] = true
		}
		if bi.Home != nil {
			u.Homes++
			nodes[bi.Home.Node] = true
		}
	}
	for b, used := range snap.Used {
		if match(b) {
			u.Addresses += len(used)
		}
	}
	for addr, node := range snap.Lent {
		if match(netip.PrefixFrom(addr, addr.BitLen())) {
			nodes[node] = true
		}
	}
	for n := range nodes {
		u.Nodes = append(u.Nodes, n)
	}
	slices.Sort(u.Nodes)
	return u
}
