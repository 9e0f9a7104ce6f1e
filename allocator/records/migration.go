package records

import (
	"context"
	"errors"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// Live migration. A VM that moves between nodes runs in two pods for a
// while (KubeVirt's source and target launcher pods): the target starts
// while the guest still runs in the source. The target of a migration of
// a sticky identity is admitted as the identity's alternate: a second,
// non-forwarding owner of the same addresses, named in the binding and in
// every address's record, in one transaction with them. Exactly one of
// the two forwards: the owner the records name (Owner, Node), whose node
// every route points at (a block's home, or the address's own home when
// it is borrowed). The cut-over, one transaction, swaps them: the
// alternate becomes the owner, its node the address's home, and the
// former owner the alternate until its DEL (or, when its pod is gone,
// nobody).

// Alternate is the second, non-forwarding owner of a sticky identity's
// addresses during a live migration.
type Alternate struct {
	Owner Owner     `json:"owner"`
	Node  string    `json:"node"`
	Since time.Time `json:"since"`
	// Migration names the migration (KubeVirt's migration job name, or
	// the kvipam.io/migration-target annotation's value).
	Migration string `json:"migration,omitempty"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// ErrMigration marks a migration request refused for what the identity
// holds now (no migration of it to cut over, another one in progress).
var ErrMigration = errors.New("allocator: live migration refused")

// ErrAlternateGone is a cut-over refused because the alternate's node
// has no live record: its pod cannot forward.
var ErrAlternateGone = errors.New("allocator: the alternate's node has no live record")

// Migrations are the three writes of a live migration. Each compares the
// binding and every record it rewrites at the revisions read, and writes
// them all in one transaction; a lost race wraps ErrConflict.
type Migrations interface {
	// Admit makes alt the alternate of b's addresses: b and the records
	// of b's owner at them (cur, as read) name alt. It is refused while
	// the cluster's schema level does not include the migration-owner
	// feature (a version that does not know alternates would drop them),
	// and while b has an alternate on a live node (ErrMigration); one on
	// a node with no live record gives way.
	Admit(ctx context.Context, b Binding, cur []Allocation, alt Alternate) (Binding, error)
	// CutOver makes b's alternate the owner of b's addresses, and the
	// node the address routes to: each record and b name it, and a
	// borrowed address's home names its node (an address of a block
	// the new node holds has none). The former owner becomes the
	// alternate when keepOld is set (its pod still runs), else nobody.
	// It is refused while the alternate's node has no live record.
	CutOver(ctx context.Context, b Binding, cur []Allocation, keepOld bool) (Binding, error)
	// DropAlternate removes b's alternate from b and from the records at
	// cur: its pod is gone, or the migration failed.
	DropAlternate(ctx context.Context, b Binding, cur []Allocation) (Binding, error)
}
