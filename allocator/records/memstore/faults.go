package memstore

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Fault is what a store wrapped by WithFaults does with one call.
type Fault int

// The faults of a call to etcd, as the node allocator meets them.
const (
	// Pass: the call goes through, and its answer comes back.
	Pass Fault = iota
	// Refuse: etcd refused the call before acting on it ("too many
	// requests", a dropped proposal): nothing applied, and the error
	// says so (ErrUnavailable and ErrRefused), so the caller need not
	// read it back.
	Refuse
	// Lost: the call never reached etcd, but the caller cannot know it
	// (a deadline): nothing applied, ErrUnavailable.
	Lost
	// Unknown: the call applied and its answer was lost (a deadline, a
	// connection cut after the commit): ErrUnavailable, whatever it did.
	Unknown
)

func (f Fault) String() string {
	switch f {
	case Pass:
		return "pass"
	case Refuse:
		return "refuse"
	case Lost:
		return "lost"
	case Unknown:
		return "unknown"
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Call is one store call, as a fault plan sees it: the method's name
// and its main argument (the writes, the block, the allocation, the
// binding).
type Call struct {
	Op  string
	Arg any
}

// WithFaults wraps s so that decide chooses the fault of every call,
// mirroring what the node allocator's hookStore does on etcd. decide is
// called once per call, under no lock of the store's; it must be safe
// for concurrent use if the store is used concurrently.
func WithFaults(s records.Store, decide func(Call) Fault) records.Store {
	return &faulty{s: s, decide: decide}
}

var _ records.Store = (*faulty)(nil)

type faulty struct {
	s      records.Store
	decide func(Call) Fault
}

// do runs one call under the fault decide picks for it.
func do[T any](f *faulty, op string, arg any, call func() (T, error)) (T, error) {
	var zero T
	switch fault := f.decide(Call{Op: op, Arg: arg}); fault {
	case Refuse:
		return zero, fmt.Errorf("%s: injected: etcdserver: too many requests (%w: %w)", op, retry.ErrUnavailable, retry.ErrRefused)
	case Lost:
		return zero, fmt.Errorf("%s: injected: context deadline exceeded, not sent (%w)", op, retry.ErrUnavailable)
	case Unknown:
		_, _ = call()
		return zero, fmt.Errorf("%s: injected: context deadline exceeded, applied (%w)", op, retry.ErrUnavailable)
	}
	return call()
}

// none adapts a call with no result but its error.
func none(call func() error) func() (struct{}, error) {
	return func() (struct{}, error) { return struct{}{}, call() }
}

func (f *faulty) GetPool(ctx context.Context, name string) (allocator.Pool, error) {
	return do(f, "GetPool", name, func() (allocator.Pool, error) { return f.s.GetPool(ctx, name) })
}

func (f *faulty) ListPools(ctx context.Context) ([]allocator.Pool, error) {
	return do(f, "ListPools", nil, func() ([]allocator.Pool, error) { return f.s.ListPools(ctx) })
}

func (f *faulty) EnsurePool(ctx context.Context, p allocator.Pool) (allocator.Pool, error) {
	return do(f, "EnsurePool", p, func() (allocator.Pool, error) { return f.s.EnsurePool(ctx, p) })
}

func (f *faulty) SeedPool(ctx context.Context, p allocator.Pool) (allocator.Pool, bool, error) {
	type seeded struct {
		p  allocator.Pool
		ok bool
	}
	r, err := do(f, "SeedPool", p, func() (seeded, error) {
		p, ok, err := f.s.SeedPool(ctx, p)
		return seeded{p, ok}, err
	})
	return r.p, r.ok, err
}

func (f *faulty) ListBlocks(ctx context.Context, pool string) ([]records.BlockInfo, error) {
	return do(f, "ListBlocks", pool, func() ([]records.BlockInfo, error) { return f.s.ListBlocks(ctx, pool) })
}

func (f *faulty) PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	return do(f, "PeekBlocks", blocks, func() (map[netip.Prefix]records.BlockInfo, error) { return f.s.PeekBlocks(ctx, pool, blocks) })
}

func (f *faulty) GetBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	return do(f, "GetBlocks", blocks, func() (map[netip.Prefix]records.BlockInfo, error) { return f.s.GetBlocks(ctx, pool, blocks) })
}

func (f *faulty) Claim(ctx context.Context, pool string, b netip.Prefix, c records.Claim, lease int64) (records.WriteResult, error) {
	return do(f, "Claim", b, func() (records.WriteResult, error) { return f.s.Claim(ctx, pool, b, c, lease) })
}

func (f *faulty) Reclaim(ctx context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	return do(f, "Reclaim", prev, func() (int64, error) { return f.s.Reclaim(ctx, pool, prev, c, lease) })
}

func (f *faulty) Unclaim(ctx context.Context, pool string, b netip.Prefix, claimRev int64) error {
	_, err := do(f, "Unclaim", b, none(func() error { return f.s.Unclaim(ctx, pool, b, claimRev) }))
	return err
}

func (f *faulty) LeaseExpiry(ctx context.Context, lease int64) (time.Time, error) {
	return do(f, "LeaseExpiry", lease, func() (time.Time, error) { return f.s.LeaseExpiry(ctx, lease) })
}

func (f *faulty) ListIPs(ctx context.Context, pool string, b netip.Prefix) ([]records.Allocation, error) {
	return do(f, "ListIPs", b, func() ([]records.Allocation, error) { return f.s.ListIPs(ctx, pool, b) })
}

func (f *faulty) WriteIPs(ctx context.Context, writes []records.IPWrite) (records.WriteResult, error) {
	return do(f, "WriteIPs", writes, func() (records.WriteResult, error) { return f.s.WriteIPs(ctx, writes) })
}

func (f *faulty) GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error) {
	return do(f, "GetIPs", refs, func() (map[netip.Addr]records.Allocation, error) { return f.s.GetIPs(ctx, refs) })
}

func (f *faulty) DeleteIP(ctx context.Context, al records.Allocation) error {
	_, err := do(f, "DeleteIP", al, none(func() error { return f.s.DeleteIP(ctx, al) }))
	return err
}

func (f *faulty) RecordLapsed(ctx context.Context, al records.Allocation, end time.Time) (bool, error) {
	return do(f, "RecordLapsed", al, func() (bool, error) { return f.s.RecordLapsed(ctx, al, end) })
}

func (f *faulty) PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error) {
	return do(f, "PoolSnapshot", pool, func() (records.PoolSnapshot, error) { return f.s.PoolSnapshot(ctx, pool) })
}

func (f *faulty) FenceBorrower(ctx context.Context, c records.Claim, lease int64) (int64, error) {
	return do(f, "FenceBorrower", c, func() (int64, error) { return f.s.FenceBorrower(ctx, c, lease) })
}

func (f *faulty) ListLent(ctx context.Context, pool string) (map[netip.Addr]string, error) {
	return do(f, "ListLent", pool, func() (map[netip.Addr]string, error) { return f.s.ListLent(ctx, pool) })
}

func (f *faulty) LastReleased(ctx context.Context, pool string, addrs []netip.Addr) (map[netip.Addr]time.Time, error) {
	return do(f, "LastReleased", addrs, func() (map[netip.Addr]time.Time, error) { return f.s.LastReleased(ctx, pool, addrs) })
}

func (f *faulty) GetBinding(ctx context.Context, pool, identity string) (records.Binding, bool, error) {
	type found struct {
		b  records.Binding
		ok bool
	}
	r, err := do(f, "GetBinding", identity, func() (found, error) {
		b, ok, err := f.s.GetBinding(ctx, pool, identity)
		return found{b, ok}, err
	})
	return r.b, r.ok, err
}

func (f *faulty) WriteBound(ctx context.Context, b records.Binding, writes []records.IPWrite) (records.WriteResult, error) {
	return do(f, "WriteBound", b, func() (records.WriteResult, error) { return f.s.WriteBound(ctx, b, writes) })
}

func (f *faulty) Keep(ctx context.Context, b records.Binding, als []records.Allocation) (time.Time, error) {
	return do(f, "Keep", b, func() (time.Time, error) { return f.s.Keep(ctx, b, als) })
}

func (f *faulty) ListBindings(ctx context.Context, pool string) ([]records.Binding, error) {
	return do(f, "ListBindings", pool, func() ([]records.Binding, error) { return f.s.ListBindings(ctx, pool) })
}

func (f *faulty) DropStaleBinding(ctx context.Context, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	_, err := do(f, "DropStaleBinding", b, none(func() error { return f.s.DropStaleBinding(ctx, b, refs, cur) }))
	return err
}

func (f *faulty) Admit(ctx context.Context, b records.Binding, cur []records.Allocation, alt records.Alternate) (records.Binding, error) {
	return do(f, "Admit", b, func() (records.Binding, error) { return f.s.Admit(ctx, b, cur, alt) })
}

func (f *faulty) CutOver(ctx context.Context, b records.Binding, cur []records.Allocation, keepOld bool) (records.Binding, error) {
	return do(f, "CutOver", b, func() (records.Binding, error) { return f.s.CutOver(ctx, b, cur, keepOld) })
}

func (f *faulty) DropAlternate(ctx context.Context, b records.Binding, cur []records.Allocation) (records.Binding, error) {
	return do(f, "DropAlternate", b, func() (records.Binding, error) { return f.s.DropAlternate(ctx, b, cur) })
}
