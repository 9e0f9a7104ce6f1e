package records

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// Adoption of a running cluster (kvipamctl import). Another IPAM's live
// allocations (host-local's files, whereabouts' IPPools) become kvipam
// records owned by the same attachments, block by block: one block's
// claim (for the node whose pods hold its addresses), its records, and
// the marks that tell each node's agent what was imported for it are one
// transaction, so no block is ever half imported. An imported record is
// an ordinary allocated record (Record.Imported names its source): the
// node's agent holds it as its own once it has learned of it through its
// mark, and the DEL of the old pod, now arriving at kvipam, frees it.

// ImportedIP is one address an import writes: a new record, allocated.
// Record.Borrowed marks an address held in a block claimed by another
// node (whereabouts' ranges are cluster wide).
type ImportedIP struct {
	Addr   netip.Addr
	Record Record
}

// ImportMark tells node's agent what an import wrote for it in one block:
// the addresses it holds now and whether they are borrowed. It has no
// lease; kvipamctl import finalize drops it.
type ImportMark struct {
	Source string       `json:"source"`
	Node   string       `json:"node"`
	Pool   string       `json:"pool"`
	Block  netip.Prefix `json:"block"`
	// Addrs are every address imported from Source for Node in Block,
	// over all runs of the import.
	Addrs []netip.Addr `json:"addrs"`
	// Borrowed: Block is claimed by another node, and Node holds Addrs
	// as borrowed addresses.
	Borrowed bool      `json:"borrowed,omitempty"`
	At       time.Time `json:"at"`
	// Rev is the revision the mark was written at (not stored).
	Rev int64 `json:"-"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// ImportBlock is one block's share of an import, written by
// Importer.ImportBlock in one transaction.
type ImportBlock struct {
	Pool  string
	Block netip.Prefix
	// Claimant is the node that holds (or takes) the block's claim, and
	// Lease its live agent's lease, read from its node record: the claim
	// is written on it, and the transaction fails if the node's record is
	// no longer on it (the agent restarted or is gone).
	Claimant string
	BootID   string
	Lease    int64
	// ClaimRev is zero to take the block (no claim, no allocation in it:
	// the claim and the home are written), or the revision of Claimant's
	// claim found on Lease, which must be unchanged.
	ClaimRev int64
	// PoolRev is the pool spec's revision read: it must be unchanged.
	PoolRev int64
	// IPs are the new records; each address must be free.
	IPs []ImportedIP
	// Borrowers maps each node that holds an address of IPs as borrowed
	// to its borrow fence's revision and lease (FenceBorrower).
	Borrowers map[string]BorrowFence
	// Marks are one per node with addresses in IPs, each replacing the
	// mark at its Rev (zero: none yet).
	Marks []ImportMark
}

// BorrowFence is a borrower's fence as the import read it.
type BorrowFence struct {
	Rev   int64
	Lease int64
}

// Ops counts the puts of b's transaction: etcd refuses one of more than
// its --max-txn-ops (128 by default) puts or compares.
func (b ImportBlock) Ops() (puts, cmps int) {
	puts = len(b.IPs) + len(b.Marks)
	cmps = 3 + len(b.Borrowers) + len(b.Marks)
	if b.ClaimRev == 0 {
		puts += 2
		cmps++
	} else {
		cmps += len(b.IPs)
	}
	for _, ip := range b.IPs {
		if ip.Record.Borrowed {
			puts++
			cmps++
		}
	}
	return puts, cmps
}

// Importer writes an import and reads it back. Its writes wrap
// ErrConflict when anything they compare changed since it was read (plan
// again), and ErrLeaseLost when a node's lease is not the one given.
type Importer interface {
	// ImportBlock writes b in one transaction and returns its revision.
	ImportBlock(ctx context.Context, b ImportBlock) (int64, error)
	// ListImportMarks reads every import mark, of every node.
	ListImportMarks(ctx context.Context) ([]ImportMark, error)
	// FinalizeImport drops the marks of source, each at the revision
	// read, and records that source was finalized. It returns the marks
	// dropped.
	FinalizeImport(ctx context.Context, source string) ([]ImportMark, error)
}

// ErrImportTooBig is a block whose import needs more operations than one
// etcd transaction takes (--max-txn-ops, 128 by default).
var ErrImportTooBig = errors.New("allocator: import: too many operations for one transaction")

// ErrImportConflict marks an address the import would write that kvipam
// gives to another owner already.
var ErrImportConflict = errors.New("allocator: import conflicts with an allocation")

// ImportConflictError names both owners of an address an import refused.
type ImportConflictError struct {
	Pool  string
	Addr  netip.Addr
	Held  Allocation // kvipam's record
	Want  Owner      // the source's owner
	Node  string     // the source's node
	Block netip.Prefix
}

func (e *ImportConflictError) Error() string {
	return fmt.Sprintf("import %s of pool %s (block %s): kvipam gives it to %s on node %s, the source to %s on node %s: nothing of the block written",
		e.Addr, e.Pool, e.Block, e.Held.Owner.Key(), e.Held.Node, e.Want.Key(), e.Node)
}

// Is makes an ImportConflictError an ErrImportConflict.
func (e *ImportConflictError) Is(target error) bool { return target == ErrImportConflict }
