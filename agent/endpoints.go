package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/keylock"
)

// endpointManager owns the node's endpoints: the datapath state and the
// on-disk record of each attachment, and the release of its allocations.
// The requests of one owner (create, delete, release) are serialized,
// since each touches its datapath, record and allocations together;
// different owners' run at once, and a whole-node pass (restore, recheck,
// verify, GC) runs alone. It is safe for concurrent use.
type endpointManager struct {
	alloc   endpointAllocator
	dp      Datapath
	records *endpointRecords
	// holders reads who holds an address now, for reports of lost
	// endpoints.
	holders interface {
		holder(ctx context.Context, addr netip.Addr) (pool string, al *records.Allocation, err error)
	}
	// lost, if set, publishes endpoints found lost (metrics, node record).
	lost interface {
		reportLost(ctx context.Context, lost []etcdstore.LostEndpoint)
	}
	// freed, if set, is told when a release freed addresses.
	freed interface{ clear() }
	// reasserted counts allocations written back after etcd lost them.
	reasserted prometheus.Counter
	// reaper retires the host veths of DELs and deletes them later.
	reaper interface {
		retire(name string) (int, error)
		retiredEndpoint(ep api.Endpoint)
		reap() error
	}
	// migrations, if set, is told of every endpoint created: a live
	// migration's second owner is watched for its guest.
	migrations interface {
		created(api.Endpoint)
		// leftForwarding takes the host routes from an endpoint found
		// cut over to another node.
		leftForwarding(api.Endpoint) error
	}
	delQueueDir string
	log         hclog.Logger

	// mu is held exclusively by whole-node passes, and shared, with the
	// owner's lock in owners, by one owner's requests (lockOwner).
	mu     sync.RWMutex
	owners keylock.Map[string]
}

// lockOwner takes what one owner's request needs and returns its unlock.
func (m *endpointManager) lockOwner(o api.Owner) (unlock func()) {
	m.mu.RLock()
	done := m.owners.Lock(o.Key())
	return func() {
		done()
		m.mu.RUnlock()
	}
}

// endpointAllocator is what the endpoint manager needs of the allocator.
type endpointAllocator interface {
	Lookup(o records.Owner) []records.Allocation
	// Alternate is what a live migration's target was admitted to.
	Alternate(o records.Owner) []records.Allocation
	Confirm(ctx context.Context, o records.Owner) ([]records.Allocation, error)
	ReleaseAs(ctx context.Context, o records.Owner, identity string) ([]records.Allocation, error)
	ReleaseAllocation(ctx context.Context, al records.Allocation) (bool, error)
	Reassert(ctx context.Context, held []nodealloc.HeldAddr) ([]records.Allocation, []nodealloc.Conflict, error)
}

// create finishes an ADD: the owner's reservation becomes permanent (a
// fenced etcd write) while the datapath is programmed and the record
// saved, and all three are done before the answer. They overlap because
// none needs another's result: the pod already has its addresses on its
// interface, and until the answer it is not running. If the confirm
// fails (the reservation lapsed), the datapath and the record are undone
// before the error is returned. Any failure leaves the allocation for the
// plugin's rollback (release) to undo.
func (m *endpointManager) create(ctx context.Context, req api.EndpointRequest) (api.Endpoint, error) {
	defer m.lockOwner(req.Owner)()
	owner := req.Owner
	held := m.alloc.Lookup(owner)
	alternate := false
	if len(held) == 0 {
		// A live migration's target holds its identity's addresses as
		// their second, non-forwarding owner: nothing to confirm.
		held, alternate = m.alloc.Alternate(owner), true
	}
	if len(held) == 0 {
		return api.Endpoint{}, fmt.Errorf("no reservation for %s: allocate first, or it expired: %w", owner.Key(), ErrNotFound)
	}
	var ips []netip.Addr
	var identity, pool string
	var window int64
	for _, al := range held {
		ips = append(ips, al.Addr)
		pool = al.Pool
		if al.Identity != "" {
			identity, window = al.Identity, al.WindowSeconds
		}
	}
	for i, p := range req.IPs {
		if !slices.Contains(ips, p.Addr()) {
			field := fmt.Sprintf("ips[%d]", i)
			return api.Endpoint{}, &FieldError{Field: field, Msg: fmt.Sprintf("%s %q is not held by %s (holds %v)", field, p, owner.Key(), ips)}
		}
	}
	ports, err := checkPortMappings(req.PortMappings, m.dp.Name())
	if err != nil {
		return api.Endpoint{}, err
	}
	start := time.Now()
	confirmed := make(chan error, 1)
	var confirmTook time.Duration
	go func() {
		var err error
		if !alternate {
			_, err = m.alloc.Confirm(ctx, owner)
		}
		confirmTook = time.Since(start)
		confirmed <- err
	}()
	ep := api.Endpoint{
		Owner: req.Owner, HostIfName: req.HostIfName, ContainerIfName: req.ContainerIfName,
		ContainerMAC: req.ContainerMAC, Netns: req.Netns, IPs: ips, EgressLimited: req.EgressLimited, Datapath: m.dp.Name(), Created: time.Now().UTC(),
		StickyIdentity: identity, StickyWindowSeconds: window, Pool: pool, Alternate: alternate, PortMappings: ports,
	}
	m.records.assignID(&ep)
	if old, ok := m.records.get(owner); ok && old.HostIfIndex != 0 {
		// The ADD again without a DEL between (a live migration's
		// target retried; the plugin replaced the veth): the old veth's
		// datapath state goes first, or the new one is refused as
		// another interface's (bpf's address map names the old
		// ifindex).
		if err := m.dp.Teardown(ctx, old); err != nil {
			return api.Endpoint{}, fmt.Errorf("tear down the endpoint of %s's earlier ADD: %w", owner.Key(), err)
		}
	}
	datapath, record, err := m.program(ctx, &ep)
	if cerr := <-confirmed; cerr != nil {
		if err == nil {
			if uerr := m.deleteLocked(ctx, ep.Owner); uerr != nil {
				m.log.Warn("confirm failed; removing the endpoint", "owner", ep.Owner.Key(), "error", uerr)
			}
		}
		return api.Endpoint{}, cerr
	}
	if err != nil {
		return api.Endpoint{}, err
	}
	if m.migrations != nil {
		m.migrations.created(ep)
	}
	m.log.Debug("endpoint created", "owner", ep.Owner.Key(), "id", ep.ID, "ips", ep.IPs, "host_if", ep.HostIfName,
		"confirm", confirmTook, "datapath", datapath, "record", record, "took", time.Since(start))
	return ep, nil
}

// program sets up the datapath for ep and saves its record, returning
// how long each took. On failure neither is left behind.
func (m *endpointManager) program(ctx context.Context, ep *api.Endpoint) (datapath, record time.Duration, _ error) {
	start := time.Now()
	if err := m.dp.Setup(ctx, ep); err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return 0, 0, &FieldError{Field: "hostIfName", Msg: err.Error()}
		}
		return 0, 0, fmt.Errorf("program datapath: %w", portInUse(err, m.records.list()))
	}
	datapath = time.Since(start)
	if err := m.records.put(*ep); err != nil {
		_ = m.dp.Teardown(ctx, *ep)
		return 0, 0, err
	}
	return datapath, time.Since(start) - datapath, nil
}

// list returns every endpoint ordered by ID.
func (m *endpointManager) list() []api.Endpoint { return m.records.list() }

// deleteLocked removes an endpoint's datapath state and record, keeping
// its IPs; deleting what does not exist succeeds. It and releaseLocked
// need the owner's lock or m.mu.
func (m *endpointManager) deleteLocked(ctx context.Context, o api.Owner) error {
	ep, ok := m.records.get(o)
	if !ok {
		return nil
	}
	if err := m.dp.Teardown(ctx, ep); err != nil {
		return fmt.Errorf("tear down endpoint %s: %w", o.Key(), err)
	}
	return m.records.remove(o)
}

// release tears the owner's endpoint down and frees its IPs; idempotent.
// hostIf, when set, is the attachment's host veth (DEL): it is retired
// before anything is released, and the endpoint on it is retired with it
// (the datapath drops its traffic) rather than torn down; the reaper
// deletes both later. identity, if set, is the sticky identity the DEL
// names (identityFor). It returns what became of hostIf.
func (m *endpointManager) release(ctx context.Context, o api.Owner, hostIf, identity string) ([]string, string, error) {
	// The veth is the kernel's, not the manager's: it is retired outside
	// the lock, so that concurrent DELs' netlink work overlaps.
	var state string
	var ifindex int
	if hostIf != "" {
		var err error
		if ifindex, err = m.reaper.retire(hostIf); err != nil {
			return nil, "", err
		}
		state = api.HostIfAbsent
		if ifindex != 0 {
			state = api.HostIfRetired
		}
	}
	defer m.lockOwner(o)()
	ep, _ := m.records.get(o)
	identity, err := m.identityFor(o, cmp.Or(ep.StickyIdentity, identity)) // before the retire removes the record
	if err != nil {
		return nil, state, err
	}
	if ifindex != 0 {
		if err := m.retireLocked(ctx, o, hostIf, ifindex); err != nil {
			return nil, state, err
		}
	}
	ips, err := m.releaseLocked(ctx, o, identity)
	return ips, state, err
}

// identityFor is the sticky identity o's release names: named (its
// endpoint's, else the DEL's), else the one an earlier release of o that
// has not landed was noted under. It is noted durably before anything of
// o is removed (endpointRecords.noteReleasing), so that a release that
// fails, and an agent that restarts, do not lose it: the runtime's retry
// still names it to the allocator, which drops a binding naming the
// container when the cache knows nothing of it.
func (m *endpointManager) identityFor(o api.Owner, named string) (string, error) {
	id := named
	if id == "" {
		var err error
		if id, err = m.records.releasingAs(o); err != nil {
			m.log.Warn("cannot read the note of an earlier release; releasing without it", "owner", o.Key(), "error", err)
		}
	}
	if id == "" {
		return "", nil
	}
	return id, m.records.noteReleasing(o, id)
}

// retireLocked retires o's endpoint if it is the one on the retired veth
// ifindex, and hands it to the reaper. Any other endpoint of o is torn
// down by releaseLocked.
func (m *endpointManager) retireLocked(ctx context.Context, o api.Owner, hostIf string, ifindex int) error {
	ep, ok := m.records.get(o)
	if !ok || ep.HostIfName != hostIf || ep.HostIfIndex != ifindex {
		return nil
	}
	if err := m.dp.Retire(ctx, ep); err != nil {
		return fmt.Errorf("retire endpoint %s: %w", o.Key(), err)
	}
	if err := m.records.remove(o); err != nil {
		return err
	}
	m.reaper.retiredEndpoint(ep)
	return nil
}

// releaseLocked tears o's endpoint down and frees its addresses. identity
// is the sticky identity the release names, if any (identityFor, which
// noted it): the allocator drops a binding naming o even if it knows
// nothing of o. The note goes once the release has landed.
func (m *endpointManager) releaseLocked(ctx context.Context, o api.Owner, identity string) ([]string, error) {
	if err := m.deleteLocked(ctx, o); err != nil {
		return nil, err
	}
	rel, err := m.alloc.ReleaseAs(ctx, o, identity)
	out := make([]string, 0, len(rel))
	for _, al := range rel {
		out = append(out, al.Addr.String())
	}
	if len(rel) > 0 && m.freed != nil {
		m.freed.clear()
	}
	if err == nil && identity != "" {
		if rerr := m.records.released(o); rerr != nil {
			m.log.Warn("release landed; its note stays (harmless: it names the identity to a later DEL of the same container)", "owner", o.Key(), "error", rerr)
		}
	}
	return out, err
}

// releaseEndpoint releases ep's owner as release does, but only if ep is
// still the owner's endpoint (same ID and creation time): the reconciler
// judged that one, not a later ADD of the same attachment. same reports
// whether it was.
func (m *endpointManager) releaseEndpoint(ctx context.Context, ep api.Endpoint) (ips []string, same bool, err error) {
	defer m.lockOwner(ep.Owner)()
	cur, ok := m.records.get(ep.Owner)
	if !ok || cur.ID != ep.ID || !cur.Created.Equal(ep.Created) {
		return nil, false, nil
	}
	identity, err := m.identityFor(ep.Owner, ep.StickyIdentity)
	if err != nil {
		return nil, true, err
	}
	ips, err = m.releaseLocked(ctx, ep.Owner, identity)
	return ips, true, err
}

// releaseAllocations frees allocations GC decided on from a snapshot. Each
// is released only if etcd still holds it at the snapshot's revision, so
// an address that was deleted and handed to a new owner since is left
// alone. The owner's endpoint is torn down once it holds nothing more.
func (m *endpointManager) releaseAllocations(ctx context.Context, als []records.Allocation) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	var errs []error
	for _, al := range als {
		gone, err := m.alloc.ReleaseAllocation(ctx, al)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !gone {
			m.log.Info("gc: allocation changed since GC decided; left alone", "ip", al.Addr, "owner", al.Owner.Key())
			continue
		}
		out = append(out, al.Addr.String())
		o := api.Owner{ContainerID: al.ContainerID, IfName: al.IfName}
		if len(m.alloc.Lookup(al.Owner)) == 0 {
			if err := m.deleteLocked(ctx, o); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if len(out) > 0 && m.freed != nil {
		m.freed.clear()
	}
	return out, errors.Join(errs...)
}

// restore keeps every endpoint whose owner still holds its IPs and lets
// the datapath adopt them. Endpoints whose IPs are gone (released by an
// operator while the agent was down, maybe taken by another node since)
// are reported and torn down (checkEndpoints).
func (m *endpointManager) restore(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	// Veths a DEL retired before the last agent could delete them go
	// first, so that the datapath finds their interfaces gone.
	if err := m.reaper.reap(); err != nil {
		m.log.Warn("could not delete the host veths retired before the restart", "error", err)
	}
	keep := m.checkEndpoints(ctx, m.records.list())
	if err := m.dp.Adopt(ctx, keep); err != nil {
		return fmt.Errorf("adopt endpoints: %w", err)
	}
	m.log.Info("restored endpoints", "count", len(keep))
	return nil
}

// recheck runs checkEndpoints over every endpoint after the lease was
// re-established: the node's blocks may have been freed and taken while
// it was cut off, with its pods still running.
func (m *endpointManager) recheck(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.checkEndpoints(ctx, m.records.list())
}

// setAlternate marks o's endpoint a live migration's second owner (alt)
// or its forwarding one, and calls apply with the endpoint under the
// owner's lock first (the host routes follow the mark). It reports the
// endpoint, and false when o has none or it is marked so already.
func (m *endpointManager) setAlternate(o api.Owner, alt bool, apply func(api.Endpoint) error) (api.Endpoint, bool, error) {
	defer m.lockOwner(o)()
	ep, ok := m.records.get(o)
	if !ok || ep.Alternate == alt {
		return ep, false, nil
	}
	if err := apply(ep); err != nil {
		return ep, false, err
	}
	ep.Alternate = alt
	return ep, true, m.records.put(ep)
}
