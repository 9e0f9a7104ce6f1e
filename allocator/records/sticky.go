package records

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// Sticky identities. A pod that asks for it (kvipam.io/sticky) keeps its
// addresses for a window after its DEL: its allocations stay in etcd as
// "kept" records on a lease of the window's length, held for its identity
// (namespace/name), and the next ADD of that identity, on any node, takes
// them over by compare-and-swap. When the lease ends the addresses return
// to the pool by themselves. The binding key says which addresses an
// identity holds and who holds them now.

// StateKept is an allocation held for a sticky identity between its pods.
const StateKept State = "kept"

// ErrIdentityInUse is an ADD for a sticky identity that another live pod
// holds.
var ErrIdentityInUse = errors.New("allocator: sticky identity held by another pod")

// Sticky asks that a request's addresses follow an identity.
type Sticky struct {
	// Identity is namespace/name: the pod's, or its kvipam.io/ip-claim.
	Identity string
	// Window is how long the addresses are kept after the pod's DEL.
	Window time.Duration
}

// Validate checks the identity's form and the window.
func (s Sticky) Validate() error {
	ns, name, ok := strings.Cut(s.Identity, "/")
	switch {
	case !ok || ns == "" || name == "" || strings.Contains(name, "/"):
		return fmt.Errorf("%w: sticky identity %q is not namespace/name", ErrBadRequest, s.Identity)
	case s.Window < time.Second || s.Window > 30*24*time.Hour:
		return fmt.Errorf("%w: sticky window %s is not between 1s and 30 days", ErrBadRequest, s.Window)
	}
	return nil
}

// Binding is a sticky identity's hold on addresses of one pool.
type Binding struct {
	Identity string       `json:"identity"`
	Addrs    []netip.Addr `json:"addrs"`
	// Owner and Node hold the addresses now; Owner is empty while they
	// are kept (no pod), and the binding then expires with them.
	Owner Owner     `json:"owner"`
	Node  string    `json:"node,omitempty"`
	Since time.Time `json:"since"`
	// WindowSeconds is how long the addresses are kept after a DEL.
	WindowSeconds int64 `json:"windowSeconds"`
	// Alternate is the identity's second, non-forwarding owner during a
	// live migration (migration.go).
	Alternate *Alternate `json:"alternate,omitempty"`
	// Pool, Rev and Lease are where and how the store holds it (not stored).
	Pool  string `json:"-"`
	Rev   int64  `json:"-"`
	Lease int64  `json:"-"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// Kept reports whether no pod holds the binding now.
func (b Binding) Kept() bool { return b.Owner.ContainerID == "" }

// Window is the binding's window.
func (b Binding) Window() time.Duration { return time.Duration(b.WindowSeconds) * time.Second }
