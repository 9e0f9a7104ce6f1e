package records

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// State is where an allocation is in its life.
type State string

// An allocation starts as a reservation (on its own short lease, so an ADD
// that never finishes cannot leak it) and becomes permanent when the
// endpoint is created.
const (
	StateReserved  State = "reserved"
	StateAllocated State = "allocated"
)

// Owner identifies who holds an IP. ContainerID and IfName are the key, as
// in the CNI spec's attachment; Namespace and Pod are informational.
type Owner struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
	Namespace   string `json:"namespace,omitempty"`
	Pod         string `json:"pod,omitempty"`
	// PodUID tells apart two pods of the same name (a StatefulSet's pod
	// re-created): K8S_POD_UID from the runtime.
	PodUID string `json:"podUID,omitempty"`
	// Network is the CNI network name, so GC from one network never
	// collects another network's attachments in a shared pool.
	Network string `json:"network,omitempty"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// Key is the identity of an attachment: container ID and interface name,
// "containerID/ifName". Names on disk are made from it (the agent's
// endpoint records, the plugin's DEL queue entries; the host veth's name
// is a hash of it), so its text must not change.
func (o Owner) Key() string { return o.ContainerID + "/" + o.IfName }

// Validate rejects an owner that cannot identify an attachment.
func (o Owner) Validate() error {
	if o.ContainerID == "" {
		return fmt.Errorf("%w: containerID is empty", ErrBadRequest)
	}
	if o.IfName == "" {
		return fmt.Errorf("%w: ifName is empty", ErrBadRequest)
	}
	return nil
}

// Record is the value stored for one allocated IP.
type Record struct {
	Owner
	Node  string    `json:"node"`
	State State     `json:"state"`
	Since time.Time `json:"since"`
	// Borrowed marks an address Node holds in a block of another node
	// (allocator/nodealloc/borrow.go): its release also removes the
	// address's home.
	Borrowed bool `json:"borrowed,omitempty"`
	// Identity is the sticky identity (namespace/name) the address
	// follows, if any (sticky.go): a release keeps it for the identity.
	Identity string `json:"identity,omitempty"`
	// WindowSeconds is the sticky identity's window, so a binding lost
	// with its record (etcd restored) can be written back
	// (allocator/nodealloc/reassert.go).
	WindowSeconds int64 `json:"windowSeconds,omitempty"`
	// Alternate is the address's second, non-forwarding owner during a
	// live migration (migration.go); nil otherwise.
	Alternate *Alternate `json:"alternate,omitempty"`
	// Imported names the source an import took the address from
	// (import.go: "host-local:NODE:NETWORK", "whereabouts:POOL"); empty
	// for an address kvipam handed out.
	Imported string `json:"imported,omitempty"`
	// Unknown keeps the members a newer version wrote that this one
	// does not know, so that a rewrite keeps them (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// Allocation is a Record as read from the store, with its place and the
// revision that guards its release.
type Allocation struct {
	Record
	Pool  string
	Block netip.Prefix
	Addr  netip.Addr
	Rev   int64
	// Lease is non-zero for a reservation; it expires with it.
	Lease int64
	// Seen is when this node learned of the allocation, on the local
	// monotonic clock; zero for allocations read by others. GC's grace
	// period counts from it, so a step of the wall clock cannot make a
	// fresh allocation look old.
	Seen time.Time
}

// IPRef names one allocation key.
type IPRef struct {
	Pool  string
	Block netip.Prefix
	Addr  netip.Addr
}

// Claim is the value stored for a node's claim on a block.
type Claim struct {
	Node      string    `json:"node"`
	BootID    string    `json:"bootID,omitempty"`
	ClaimedAt time.Time `json:"claimedAt"`
	// PoolRev, when set, is the pool spec revision the claimant read
	// (Pool.Rev; not stored): the claim fails if the spec changed since.
	PoolRev int64 `json:"-"`
	// First, when set, is an allocation written in the claim's own
	// transaction (not stored with the claim): the block's first address,
	// for the request the block is claimed for. The claim's compares (no
	// claim, an empty block) fence it; its ClaimRev and PrevRev are
	// unused, and it may not be a borrow. A reservation (Reserve) is put
	// on the reservation lease, as WriteIPs puts one. A node that starts
	// answers its first pod after one transaction, not two.
	First *IPWrite `json:"-"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// Home is the value stored for the node a block belongs to. It has no lease:
// it outlives the claim so that an orphaned block (claim expired, IPs still
// allocated) remembers whose it is, and only that node re-claims it.
type Home struct {
	Node  string    `json:"node"`
	Since time.Time `json:"since"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// BlockInfo is what the store knows of one block that has a claim or a home.
type BlockInfo struct {
	Block      netip.Prefix
	Claim      *Claim
	ClaimRev   int64
	ClaimLease int64
	Home       *Home
	HomeRev    int64
}

// Owned reports whether node holds this block's claim.
func (b BlockInfo) Owned(node string) bool { return b.Claim != nil && b.Claim.Node == node }

// IPWrite is one allocation write, fenced by the writer's claim revision.
type IPWrite struct {
	Pool     string
	Block    netip.Prefix
	ClaimRev int64
	Addr     netip.Addr
	Record   Record
	// PrevRev, when non-zero, replaces the existing allocation at that
	// revision (confirming a reservation); zero creates a new one.
	PrevRev int64
	// Reserve puts a new allocation on a reservation lease.
	Reserve bool
	// Borrowed writes into another node's block: ClaimRev is then the
	// revision of the writer's borrow fence (FenceBorrower), the block
	// must have a home, and the address gets a home of its own naming
	// the writer, which every node routes.
	Borrowed bool
	// Ends, on a sticky takeover of an earlier pod's allocation (not a
	// kept one), is that allocation: its interval ends in the same
	// transaction (IP history).
	Ends *Allocation
}

// WriteResult says what a batch write did.
type WriteResult struct {
	Rev int64
	// Expires is when reservations written by the batch lapse, if any.
	Expires time.Time
}

// Store is the durable, shared side of allocation: etcd in production
// (allocator/etcdstore). Every method is one atomic step; the fences that
// keep invariants 1-3 hold live in these steps, not in the caller's
// memory. Implementations must be safe for concurrent use. It is the sum
// of the roles below; a consumer names the roles it uses.
type Store interface {
	Pools
	Claims
	IPs
	Loans
	Bindings
	Migrations
}

// PoolReader reads pool specs.
type PoolReader interface {
	GetPool(ctx context.Context, name string) (allocator.Pool, error)
	// ListPools reads every pool's spec: a node serves what etcd holds.
	ListPools(ctx context.Context) ([]allocator.Pool, error)
}

// Pools reads and writes pool specs.
type Pools interface {
	PoolReader
	// EnsurePool creates the pool or checks that the stored spec may be
	// replaced by p (CheckPoolUpdate) and stores it. It returns the stored pool.
	EnsurePool(ctx context.Context, p allocator.Pool) (allocator.Pool, error)
	// SeedPool creates p only if the store has no pool of its name
	// (create-if-absent) and returns the stored pool, and whether this
	// call created it. It never changes a stored pool.
	SeedPool(ctx context.Context, p allocator.Pool) (stored allocator.Pool, created bool, err error)
}

// Claims are the blocks' claims and homes.
type Claims interface {
	// ListBlocks returns every block of the pool that has a claim or a home,
	// read at one revision.
	ListBlocks(ctx context.Context, pool string) ([]BlockInfo, error)
	// GetBlocks reads the claims and homes of blocks; a block with
	// neither is absent from the map. It is how a claim whose outcome is
	// unknown (a timeout, a lost connection) is resolved.
	GetBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]BlockInfo, error)
	// PeekBlocks reads the claims and homes of blocks as GetBlocks does,
	// but may answer from a state that lags the store's (etcd: a
	// serializable read, served by the member asked, with no consensus
	// round): a hint of which blocks other nodes hold, never proof that
	// a block is free or that a claim did not land.
	PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]BlockInfo, error)
	// Claim takes a block that is unclaimed and empty, on the given lease,
	// and makes node its home, writing c.First with it if set; the result
	// has the claim's revision, and when c.First's reservation lapses. A
	// lost race returns a *ClaimError.
	Claim(ctx context.Context, pool string, block netip.Prefix, c Claim, lease int64) (WriteResult, error)
	// Reclaim takes back a block whose home is c.Node, as seen in prev: an
	// orphaned block (prev has no claim) or this node's claim on an older
	// lease. Anything changed since prev returns a *ClaimError.
	Reclaim(ctx context.Context, pool string, prev BlockInfo, c Claim, lease int64) (rev int64, err error)
	// Unclaim gives up an empty block still claimed at claimRev.
	Unclaim(ctx context.Context, pool string, block netip.Prefix, claimRev int64) error
}

// LeaseReader says when a lease ends.
type LeaseReader interface {
	// LeaseExpiry says when a reservation lease ends (now, if it has).
	LeaseExpiry(ctx context.Context, lease int64) (time.Time, error)
}

// IPs are the allocation records.
type IPs interface {
	LeaseReader
	// ListIPs returns the allocations of one block.
	ListIPs(ctx context.Context, pool string, block netip.Prefix) ([]Allocation, error)
	// WriteIPs applies all writes in one transaction or none. It fails with
	// a *WriteError when a fence or an existence check fails.
	WriteIPs(ctx context.Context, writes []IPWrite) (WriteResult, error)
	// GetIPs reads the allocations at refs, at one revision; an address
	// with no allocation is absent from the map. It is how a write whose
	// outcome is unknown (a timeout, a lost connection) is resolved.
	GetIPs(ctx context.Context, refs []IPRef) (map[netip.Addr]Allocation, error)
	// DeleteIP releases al if it is still at al.Rev; absent is success,
	// a changed key wraps ErrConflict. The store records the ownership
	// interval that ends (IP history) in the same atomic step.
	DeleteIP(ctx context.Context, al Allocation) error
	// RecordLapsed records in IP history that reservation al lapsed at
	// end. It reports false when the store still holds al as it was (its
	// lease has not ended there yet): ask again later.
	RecordLapsed(ctx context.Context, al Allocation, end time.Time) (bool, error)
}

// Loans are addresses borrowed across blocks.
type Loans interface {
	// PoolSnapshot reads a pool's claims, homes, lent addresses and
	// allocated addresses (not their records) at one revision: what
	// borrowing and an exhaustion report decide on.
	PoolSnapshot(ctx context.Context, pool string) (PoolSnapshot, error)
	// FenceBorrower puts the node's borrow fence on lease (or finds its
	// own there) and returns its revision, which fences borrowed writes
	// as a claim's revision fences writes into a block.
	FenceBorrower(ctx context.Context, c Claim, lease int64) (int64, error)
	// ListLent returns the pool's lent addresses and the node holding each.
	ListLent(ctx context.Context, pool string) (map[netip.Addr]string, error)
	// LastReleased reads when each of addrs was last released (the end
	// of its newest interval in IP history), in one round trip; an
	// address with no history is absent. Borrowers respect the lender's
	// reuse cooldown with it.
	LastReleased(ctx context.Context, pool string, addrs []netip.Addr) (map[netip.Addr]time.Time, error)
}

// Bindings are sticky identities' bindings.
type Bindings interface {
	// GetBinding reads a sticky identity's binding; ok is false when
	// there is none.
	GetBinding(ctx context.Context, pool, identity string) (b Binding, ok bool, err error)
	// WriteBound applies writes and puts b (no lease: a pod holds it),
	// all in one transaction, if the binding is still at b.Rev (absent
	// when 0). A lost race wraps ErrConflict (a *WriteError for writes).
	WriteBound(ctx context.Context, b Binding, writes []IPWrite) (WriteResult, error)
	// Keep turns the allocations als of b's owner into kept records for
	// b's identity, and b into a kept binding, all on a new lease of b's
	// window, if b and every allocation are unchanged. It returns the
	// lease's end.
	Keep(ctx context.Context, b Binding, als []Allocation) (time.Time, error)
	// ListBindings reads every binding of a pool.
	ListBindings(ctx context.Context, pool string) ([]Binding, error)
	// DropStaleBinding deletes b, whose container holds none of its
	// addresses, if b is still at b.Rev and each address of refs is as
	// cur shows it (absent, or the record found at its revision). A
	// lost race wraps ErrConflict.
	DropStaleBinding(ctx context.Context, b Binding, refs []IPRef, cur map[netip.Addr]Allocation) error
}

// PoolSnapshot is one pool as read at one revision.
type PoolSnapshot struct {
	Rev    int64
	Blocks []BlockInfo
	// Used lists the allocated addresses of each block.
	Used map[netip.Prefix][]UsedAddr
	// Lent maps each borrowed address to the node that holds it.
	Lent map[netip.Addr]string
}

// UsedAddr is an allocated address; Lease is non-zero for a reservation.
type UsedAddr struct {
	Addr  netip.Addr
	Lease int64
}

// Errors of the allocator. Compare with errors.Is.
var (
	ErrBadRequest      = errors.New("allocator: bad request")
	ErrPoolNotFound    = errors.New("allocator: pool not found")
	ErrExhausted       = errors.New("allocator: pool exhausted")
	ErrIPInUse         = errors.New("allocator: ip in use")
	ErrNotOwned        = errors.New("allocator: block owned by another node")
	ErrNotFound        = errors.New("allocator: allocation not found")
	ErrLeaseLost       = errors.New("allocator: node lease lost, try again")
	ErrReservationGone = errors.New("allocator: reservation expired")
	ErrPoolDisabled    = errors.New("allocator: pool disabled")
	// ErrNodeNotSelected marks a request for a pool whose node selector
	// does not choose this node: it takes no new block or address there.
	ErrNodeNotSelected = errors.New("allocator: pool does not serve this node")
)

// ClaimError says why a claim transaction failed.
type ClaimError struct {
	Block     netip.Prefix
	ClaimedBy string // node holding the claim, if any
	NonEmpty  bool   // the block still holds allocations
	HomeNode  string // the block's home, if any
	// ClaimRev and ClaimLease describe the claim found, if any: a claim
	// of this node on its current lease is its own earlier write whose
	// answer was lost.
	ClaimRev   int64
	ClaimLease int64
	// PoolChanged says the pool spec changed since the claimant read it.
	PoolChanged bool
}

func (e *ClaimError) Error() string {
	switch {
	case e.PoolChanged:
		return fmt.Sprintf("claim block %s: the pool changed since it was read", e.Block)
	case e.ClaimedBy != "":
		return fmt.Sprintf("claim block %s: claimed by node %s", e.Block, e.ClaimedBy)
	case e.NonEmpty:
		return fmt.Sprintf("claim block %s: orphaned (holds allocations, home %q)", e.Block, e.HomeNode)
	default:
		return fmt.Sprintf("claim block %s: changed concurrently", e.Block)
	}
}

// Unwrap makes a ClaimError a conflict, so the claim loop retries it.
func (e *ClaimError) Unwrap() error { return retry.ErrConflict }

// WriteError says which writes of a batch failed their checks.
type WriteError struct {
	// Fenced lists blocks whose claim no longer has the writer's revision:
	// the writer has lost them. For a borrowed write: a block that has no
	// home any more (released), into which nothing may be written.
	Fenced []netip.Prefix
	// Taken lists addresses that already exist (or, for a confirm, changed).
	Taken []netip.Addr
	// FenceLost says a borrowed write's fence changed: the node's lease
	// is gone.
	FenceLost bool
}

func (e *WriteError) Error() string {
	return fmt.Sprintf("write allocations: %d block claims changed %v, %d addresses taken %v", len(e.Fenced), e.Fenced, len(e.Taken), e.Taken)
}

// Unwrap makes a WriteError a conflict.
func (e *WriteError) Unwrap() error { return retry.ErrConflict }
