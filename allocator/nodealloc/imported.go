package nodealloc

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/kvipam/kvipam/allocator/records"
)

// LearnImport folds into the cache what an import (kvipamctl import)
// wrote for this node in m's block: a block claimed for the node on its
// current lease is adopted as its own with every record in it (or read
// again, if the node holds it already); borrowed addresses are read back.
// From then on the node hands none of them out, and the DEL of an old pod
// (whose endpoint the node never made) finds its imported address and
// frees it. A block claimed by another node or on another lease is not
// adopted: the addresses are only read back. It waits for allocations
// in flight and for Restore (allocMu), and fails before Restore.
func (a *Allocator) LearnImport(ctx context.Context, m records.ImportMark) error {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	defer a.held.changed()
	if err := a.ready(); err != nil {
		return err
	}
	ps, err := a.n.Pool(m.Pool)
	if err != nil {
		return fmt.Errorf("learn import %s of block %s: %w", m.Source, m.Block, err)
	}
	refs := make([]records.IPRef, len(m.Addrs))
	for i, ad := range m.Addrs {
		refs[i] = records.IPRef{Pool: m.Pool, Block: m.Block, Addr: ad}
	}
	if !m.Borrowed {
		got, err := a.cfg.Store.GetBlocks(ctx, m.Pool, []netip.Prefix{m.Block})
		if err != nil {
			return fmt.Errorf("learn import %s: read block %s: %w", m.Source, m.Block, err)
		}
		info := got[m.Block]
		if info.Owned(a.cfg.Node) && info.ClaimLease == a.lease.ID() {
			rev := info.ClaimRev
			if ps.Owns(m.Block) {
				rev = 0 // held already: its records read again
			}
			if err := a.reads.loadBlock(ctx, ps, m.Block, rev); err != nil {
				return fmt.Errorf("learn import %s: load block %s: %w", m.Source, m.Block, err)
			}
			a.log.Info("learned imported block", "source", m.Source, "pool", m.Pool, "block", m.Block, "ips", len(m.Addrs), "claim_rev", info.ClaimRev)
			return nil
		}
	}
	if err := a.reads.readBack(ctx, refs); err != nil {
		return fmt.Errorf("learn import %s: read back %d addresses of block %s: %w", m.Source, len(refs), m.Block, err)
	}
	a.log.Info("learned imported addresses", "source", m.Source, "pool", m.Pool, "block", m.Block, "ips", len(m.Addrs), "borrowed", m.Borrowed)
	return nil
}
