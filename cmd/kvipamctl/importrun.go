package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/adopt/whereabouts"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// envImportFault is a test hook: "before:N" ends the import just before
// its Nth block transaction (N from 1), "after:N" just after it, as a
// kill of kvipamctl there would (TestImportIdempotentAndResumable).
const envImportFault = "KVIPAM_IMPORT_FAULT"

// errImportFault is the end the fault hook gives the import.
var errImportFault = errors.New("import stopped by " + envImportFault)

// importStore is what the import needs of the store.
type importStore interface {
	nodeLister
	records.Importer
	records.Loans
	GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error)
	BorrowFences(ctx context.Context) (map[string]records.BorrowFence, error)
}

var _ importStore = (*etcdstore.Store)(nil)

// importResult is what an import prints.
type importResult struct {
	adopt.Plan
	DryRun  bool                  `json:"dryRun"`
	Written int                   `json:"written"`
	Skipped []whereabouts.Skipped `json:"skipped,omitempty"`
}

// maxPlans bounds how often an import plans again after a lost race.
const maxPlans = 10

// runImport plans and writes the import of allocs from source, planning
// again (reading everything again) after any block's transaction lost a
// race, until every block is written, imported already, or refused.
func (a *app) runImport(ctx context.Context, o importOpts, source string, allocs []adopt.Allocation, skipped []whereabouts.Skipped) error {
	stop, stopAt, err := importFault(a.getenv(envImportFault))
	if err != nil {
		return err
	}
	cli, err := a.client(ctx)
	if err != nil {
		return err
	}
	s := etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1})
	res := importResult{DryRun: o.dryRun, Skipped: skipped}
	sent := 0
	again := true
	for plans := 0; again && plans < maxPlans; plans++ {
		st, err := readImportState(ctx, s, o.pool, allocs, a.now())
		if err != nil {
			return err
		}
		res.Plan = adopt.Make(source, o.network, allocs, st)
		if o.dryRun {
			break
		}
		again = false
		if len(res.NeedFences) > 0 {
			again = true
			for _, n := range res.NeedFences {
				node := st.Nodes[n]
				if _, err := s.FenceBorrower(ctx, records.Claim{Node: n, BootID: node.BootID, ClaimedAt: a.now().UTC()}, node.Lease); err != nil {
					return fmt.Errorf("import: borrow fence of node %s: %w", n, err)
				}
			}
			continue
		}
		for _, w := range res.Writes {
			sent++
			if stop == "before" && sent == stopAt {
				return errImportFault
			}
			_, err := s.ImportBlock(ctx, w)
			if stop == "after" && sent == stopAt {
				return errImportFault
			}
			switch {
			case err == nil:
				res.Written++
				fmt.Fprintf(a.stderr, "kvipamctl: imported block %s of pool %s for node %s: %d addresses\n", w.Block, w.Pool, w.Claimant, len(w.IPs))
			case errors.Is(err, retry.ErrConflict) && !errors.Is(err, records.ErrLeaseLost):
				again = true
			default:
				return fmt.Errorf("import: %w", err)
			}
		}
	}
	if again && !o.dryRun {
		return fmt.Errorf("import %s: still losing races after %d plans: run it again", source, maxPlans)
	}
	if err := a.render(a.stdout, res, func(tw io.Writer) { importRows(tw, res) }); err != nil {
		return err
	}
	if len(res.Refused) > 0 {
		return fmt.Errorf("import %s: %d blocks or addresses refused, first: %s", source, len(res.Refused), res.Refused[0].Why)
	}
	return nil
}

// importFault reads the fault hook's setting.
func importFault(v string) (string, int, error) {
	if v == "" {
		return "", 0, nil
	}
	when, n, ok := strings.Cut(v, ":")
	i, err := strconv.Atoi(n)
	if !ok || err != nil || i < 1 || (when != "before" && when != "after") {
		return "", 0, fmt.Errorf("%s=%q: want before:N or after:N", envImportFault, v)
	}
	return when, i, nil
}

// readImportState reads what the plan decides on: the live nodes from
// their records, the rest through adopt.Read.
func readImportState(ctx context.Context, s importStore, pool string, allocs []adopt.Allocation, now time.Time) (adopt.State, error) {
	nodes, err := s.ListNodes(ctx)
	if err != nil {
		return adopt.State{}, err
	}
	live := map[string]adopt.Node{}
	for _, n := range nodes {
		live[n.Name] = adopt.Node{Lease: n.Lease, BootID: n.BootID}
	}
	return adopt.Read(ctx, s, pool, allocs, live, now)
}

func importRows(tw io.Writer, r importResult) {
	row(tw, "BLOCK", "CLAIMANT", "ACTION", "NEW", "BORROWED", "ALREADY")
	for _, b := range r.Blocks {
		row(tw, b.Block, b.Claimant, b.Action, len(b.New), len(b.Borrowed), b.Already)
	}
	for _, rf := range r.Refused {
		row(tw, "refused:", rf.Why)
	}
	for _, sk := range r.Skipped {
		row(tw, "skipped:", sk.Pool, sk.Addr, sk.PodRef, sk.Why)
	}
	if r.DryRun {
		row(tw, "dry run: nothing written")
	} else {
		row(tw, "written:", r.Written, "blocks")
	}
}
