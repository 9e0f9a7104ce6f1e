package adopt

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// StateReader is what Read needs of the store.
type StateReader interface {
	GetPool(ctx context.Context, name string) (allocator.Pool, error)
	PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error)
	GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error)
	BorrowFences(ctx context.Context) (map[string]records.BorrowFence, error)
	ListImportMarks(ctx context.Context) ([]records.ImportMark, error)
}

// Read reads from s what Make decides on for allocs in pool: the pool,
// its blocks and their use, what kvipam holds at allocs' addresses, the
// borrow fences and the import marks. nodes are the live nodes, as the
// caller knows them (their records).
func Read(ctx context.Context, s StateReader, pool string, allocs []Allocation, nodes map[string]Node, now time.Time) (State, error) {
	p, err := s.GetPool(ctx, pool)
	if err != nil {
		return State{}, fmt.Errorf("import: pool %s: %w", pool, err)
	}
	st := State{Pool: p, Blocks: map[netip.Prefix]records.BlockInfo{}, Used: map[netip.Prefix]int{}, Nodes: nodes, Now: now}
	snap, err := s.PoolSnapshot(ctx, pool)
	if err != nil {
		return State{}, err
	}
	for _, bi := range snap.Blocks {
		st.Blocks[bi.Block] = bi
	}
	for b, used := range snap.Used {
		st.Used[b] = len(used)
	}
	var refs []records.IPRef
	for _, al := range allocs {
		if b, ok := p.BlockFor(al.Addr); ok {
			refs = append(refs, records.IPRef{Pool: pool, Block: b, Addr: al.Addr})
		}
	}
	if st.Held, err = s.GetIPs(ctx, refs); err != nil {
		return State{}, err
	}
	if st.Fences, err = s.BorrowFences(ctx); err != nil {
		return State{}, err
	}
	if st.Marks, err = s.ListImportMarks(ctx); err != nil {
		return State{}, err
	}
	return st, nil
}
