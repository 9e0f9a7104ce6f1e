package etcdstore

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// Holder reads who holds addr in pool p now: the allocation under the
// address's block, or nil when the address is free. It is one read of one
// key, meant for reports (an agent telling who took an address it lost);
// nothing is allocated on its answer.
func (s *Store) Holder(ctx context.Context, p allocator.Pool, addr netip.Addr) (*records.Allocation, error) {
	b, ok := p.BlockFor(addr)
	if !ok {
		return nil, fmt.Errorf("holder of %s: %w: not an address of pool %s", addr, records.ErrBadRequest, p.Name)
	}
	resp, err := s.kv.Get(ctx, IPKey(p.Name, b, addr.Unmap()))
	if err != nil {
		return nil, fmt.Errorf("holder of %s: %w", addr, kvstore.Unavailable(err))
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	al, err := DecodeAllocation(p.Name, resp.Kvs[0])
	if err != nil {
		return nil, fmt.Errorf("holder of %s: %w", addr, err)
	}
	return &al, nil
}
