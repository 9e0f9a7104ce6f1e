package nodealloc_test

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// errUnknown stands for a transport failure after which nobody knows
// whether etcd applied the request: a deadline, a lost connection.
var errUnknown = errors.New("injected: context deadline exceeded (outcome unknown)")

// errInjected is a failure before the request reached etcd.
var errInjected = errors.New("injected: etcd unavailable")

// hookStore wraps the real etcd Store and lets a test act at a chosen step
// of a chosen call: pause the caller, revoke a lease between a read and a
// compare, fail a call before it is sent, or let it commit and then report
// an error (an unknown outcome). Every call still goes to the real etcd
// unless a hook says otherwise. It is safe for concurrent use.
type hookStore struct {
	records.Store
	mu     sync.Mutex
	before map[string]func(ctx context.Context) error
	after  map[string]func(ctx context.Context, err error) error
	// observe, if set, sees each call's name and its main argument
	// (the writes, the binding, the allocation) before the Before hook.
	observe func(op string, arg any)
}

// Observe makes f see every call and its main argument before its Before
// hook runs: a test that faults writes by kind tells them apart by it.
func (h *hookStore) Observe(f func(op string, arg any)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.observe = f
}

func (h *hookStore) see(op string, arg any) {
	h.mu.Lock()
	f := h.observe
	h.mu.Unlock()
	if f != nil {
		f(op, arg)
	}
}

func newHookStore(s records.Store) *hookStore {
	return &hookStore{Store: s, before: map[string]func(context.Context) error{}, after: map[string]func(context.Context, error) error{}}
}

// Before runs f before every call of op; an error from f is returned
// without calling etcd.
func (h *hookStore) Before(op string, f func(ctx context.Context) error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.before[op] = f
}

// After runs f after every call of op with its error; f's result replaces it.
func (h *hookStore) After(op string, f func(ctx context.Context, err error) error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.after[op] = f
}

// Clear removes every hook.
func (h *hookStore) Clear() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.before)
	clear(h.after)
	h.observe = nil
}

// commitThenFail is an After hook for write calls: the write has been
// applied, and the caller is told it failed (an unknown outcome), n times.
func commitThenFail(n int) func(context.Context, error) error {
	return commitThenAnswer(n, errUnknown)
}

// commitThenAnswer is an After hook for write calls: the write has been
// applied, and the caller is told lie instead, n times.
func commitThenAnswer(n int, lie error) func(context.Context, error) error {
	var mu sync.Mutex
	return func(_ context.Context, err error) error {
		mu.Lock()
		defer mu.Unlock()
		if err != nil || n == 0 {
			return err
		}
		n--
		return lie
	}
}

// failTimes is a Before hook that fails the call n times without sending it.
func failTimes(n int, e error) func(context.Context) error {
	var mu sync.Mutex
	return func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		if n == 0 {
			return nil
		}
		n--
		return e
	}
}

func (h *hookStore) pre(ctx context.Context, op string) error {
	h.mu.Lock()
	f := h.before[op]
	h.mu.Unlock()
	if f == nil {
		return nil
	}
	return f(ctx)
}

func (h *hookStore) post(ctx context.Context, op string, err error) error {
	h.mu.Lock()
	f := h.after[op]
	h.mu.Unlock()
	if f == nil {
		return err
	}
	return f(ctx, err)
}

func (h *hookStore) ListBlocks(ctx context.Context, pool string) ([]records.BlockInfo, error) {
	if err := h.pre(ctx, "ListBlocks"); err != nil {
		return nil, err
	}
	out, err := h.Store.ListBlocks(ctx, pool)
	return out, h.post(ctx, "ListBlocks", err)
}

func (h *hookStore) GetBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	if err := h.pre(ctx, "GetBlocks"); err != nil {
		return nil, err
	}
	out, err := h.Store.GetBlocks(ctx, pool, blocks)
	return out, h.post(ctx, "GetBlocks", err)
}

func (h *hookStore) PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	if err := h.pre(ctx, "PeekBlocks"); err != nil {
		return nil, err
	}
	out, err := h.Store.PeekBlocks(ctx, pool, blocks)
	return out, h.post(ctx, "PeekBlocks", err)
}

func (h *hookStore) Claim(ctx context.Context, pool string, b netip.Prefix, c records.Claim, lease int64) (records.WriteResult, error) {
	h.see("Claim", b)
	if err := h.pre(ctx, "Claim"); err != nil {
		return records.WriteResult{}, err
	}
	res, err := h.Store.Claim(ctx, pool, b, c, lease)
	return res, h.post(ctx, "Claim", err)
}

func (h *hookStore) Reclaim(ctx context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	h.see("Reclaim", prev)
	if err := h.pre(ctx, "Reclaim"); err != nil {
		return 0, err
	}
	rev, err := h.Store.Reclaim(ctx, pool, prev, c, lease)
	return rev, h.post(ctx, "Reclaim", err)
}

func (h *hookStore) Unclaim(ctx context.Context, pool string, b netip.Prefix, claimRev int64) error {
	h.see("Unclaim", b)
	if err := h.pre(ctx, "Unclaim"); err != nil {
		return err
	}
	return h.post(ctx, "Unclaim", h.Store.Unclaim(ctx, pool, b, claimRev))
}

func (h *hookStore) ListIPs(ctx context.Context, pool string, b netip.Prefix) ([]records.Allocation, error) {
	if err := h.pre(ctx, "ListIPs"); err != nil {
		return nil, err
	}
	out, err := h.Store.ListIPs(ctx, pool, b)
	return out, h.post(ctx, "ListIPs", err)
}

func (h *hookStore) GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error) {
	if err := h.pre(ctx, "GetIPs"); err != nil {
		return nil, err
	}
	out, err := h.Store.GetIPs(ctx, refs)
	return out, h.post(ctx, "GetIPs", err)
}

func (h *hookStore) WriteIPs(ctx context.Context, writes []records.IPWrite) (records.WriteResult, error) {
	h.see("WriteIPs", writes)
	if err := h.pre(ctx, "WriteIPs"); err != nil {
		return records.WriteResult{}, err
	}
	res, err := h.Store.WriteIPs(ctx, writes)
	return res, h.post(ctx, "WriteIPs", err)
}

func (h *hookStore) LeaseExpiry(ctx context.Context, lease int64) (time.Time, error) {
	if err := h.pre(ctx, "LeaseExpiry"); err != nil {
		return time.Time{}, err
	}
	t, err := h.Store.LeaseExpiry(ctx, lease)
	return t, h.post(ctx, "LeaseExpiry", err)
}

func (h *hookStore) DeleteIP(ctx context.Context, al records.Allocation) error {
	h.see("DeleteIP", al)
	if err := h.pre(ctx, "DeleteIP"); err != nil {
		return err
	}
	return h.post(ctx, "DeleteIP", h.Store.DeleteIP(ctx, al))
}

func (h *hookStore) PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error) {
	if err := h.pre(ctx, "PoolSnapshot"); err != nil {
		return records.PoolSnapshot{}, err
	}
	out, err := h.Store.PoolSnapshot(ctx, pool)
	return out, h.post(ctx, "PoolSnapshot", err)
}

func (h *hookStore) FenceBorrower(ctx context.Context, c records.Claim, lease int64) (int64, error) {
	h.see("FenceBorrower", c)
	if err := h.pre(ctx, "FenceBorrower"); err != nil {
		return 0, err
	}
	rev, err := h.Store.FenceBorrower(ctx, c, lease)
	return rev, h.post(ctx, "FenceBorrower", err)
}

func (h *hookStore) GetBinding(ctx context.Context, pool, identity string) (records.Binding, bool, error) {
	if err := h.pre(ctx, "GetBinding"); err != nil {
		return records.Binding{}, false, err
	}
	b, ok, err := h.Store.GetBinding(ctx, pool, identity)
	return b, ok, h.post(ctx, "GetBinding", err)
}

func (h *hookStore) WriteBound(ctx context.Context, b records.Binding, writes []records.IPWrite) (records.WriteResult, error) {
	h.see("WriteBound", writes)
	if err := h.pre(ctx, "WriteBound"); err != nil {
		return records.WriteResult{}, err
	}
	res, err := h.Store.WriteBound(ctx, b, writes)
	return res, h.post(ctx, "WriteBound", err)
}

func (h *hookStore) Keep(ctx context.Context, b records.Binding, als []records.Allocation) (time.Time, error) {
	h.see("Keep", als)
	if err := h.pre(ctx, "Keep"); err != nil {
		return time.Time{}, err
	}
	end, err := h.Store.Keep(ctx, b, als)
	return end, h.post(ctx, "Keep", err)
}

func (h *hookStore) ListBindings(ctx context.Context, pool string) ([]records.Binding, error) {
	if err := h.pre(ctx, "ListBindings"); err != nil {
		return nil, err
	}
	out, err := h.Store.ListBindings(ctx, pool)
	return out, h.post(ctx, "ListBindings", err)
}

func (h *hookStore) DropStaleBinding(ctx context.Context, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	h.see("DropStaleBinding", b)
	if err := h.pre(ctx, "DropStaleBinding"); err != nil {
		return err
	}
	return h.post(ctx, "DropStaleBinding", h.Store.DropStaleBinding(ctx, b, refs, cur))
}

func (h *hookStore) RecordLapsed(ctx context.Context, al records.Allocation, end time.Time) (bool, error) {
	h.see("RecordLapsed", al)
	if err := h.pre(ctx, "RecordLapsed"); err != nil {
		return false, err
	}
	done, err := h.Store.RecordLapsed(ctx, al, end)
	return done, h.post(ctx, "RecordLapsed", err)
}

func (h *hookStore) ListLent(ctx context.Context, pool string) (map[netip.Addr]string, error) {
	if err := h.pre(ctx, "ListLent"); err != nil {
		return nil, err
	}
	out, err := h.Store.ListLent(ctx, pool)
	return out, h.post(ctx, "ListLent", err)
}

// ListPools is what Restore reads first: the node serves every pool.
func (h *hookStore) ListPools(ctx context.Context) ([]allocator.Pool, error) {
	if err := h.pre(ctx, "ListPools"); err != nil {
		return nil, err
	}
	out, err := h.Store.ListPools(ctx)
	return out, h.post(ctx, "ListPools", err)
}

// SeedPool is the agent's create-if-absent of a configured pool.
func (h *hookStore) SeedPool(ctx context.Context, p allocator.Pool) (allocator.Pool, bool, error) {
	h.see("SeedPool", p)
	if err := h.pre(ctx, "SeedPool"); err != nil {
		return allocator.Pool{}, false, err
	}
	out, created, err := h.Store.SeedPool(ctx, p)
	return out, created, h.post(ctx, "SeedPool", err)
}

// Admit, CutOver and DropAlternate are a live migration's writes.
func (h *hookStore) Admit(ctx context.Context, b records.Binding, cur []records.Allocation, alt records.Alternate) (records.Binding, error) {
	h.see("Admit", b)
	if err := h.pre(ctx, "Admit"); err != nil {
		return records.Binding{}, err
	}
	nb, err := h.Store.Admit(ctx, b, cur, alt)
	return nb, h.post(ctx, "Admit", err)
}

func (h *hookStore) CutOver(ctx context.Context, b records.Binding, cur []records.Allocation, keepOld bool) (records.Binding, error) {
	h.see("CutOver", b)
	if err := h.pre(ctx, "CutOver"); err != nil {
		return records.Binding{}, err
	}
	nb, err := h.Store.CutOver(ctx, b, cur, keepOld)
	return nb, h.post(ctx, "CutOver", err)
}

func (h *hookStore) DropAlternate(ctx context.Context, b records.Binding, cur []records.Allocation) (records.Binding, error) {
	h.see("DropAlternate", b)
	if err := h.pre(ctx, "DropAlternate"); err != nil {
		return records.Binding{}, err
	}
	nb, err := h.Store.DropAlternate(ctx, b, cur)
	return nb, h.post(ctx, "DropAlternate", err)
}
