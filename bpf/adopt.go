//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// Adopt takes over what a previous agent process left in the pin directory
// and returns the endpoints that are attached, sorted by ID. An attachment
// that is alive is kept as it is: it is never detached and re-attached, so
// enforcement has no gap; if it runs a program other than this process's (an
// older agent), the program is swapped atomically in place.
//
// Adopt also repairs what a crash can leave half done:
//   - an endpoint whose interface is gone is removed (link and map entries);
//   - an endpoint in the maps with no attachment (a crash inside Attach) is
//     attached now;
//   - a link or addresses with no endpoint (a crash inside Detach) are removed;
//   - an announcement watch of an interface with no endpoint is removed.
//
// Like Attach, Adopt must run in the network namespace of the host veths.
// It carries on past an endpoint it cannot handle and returns the errors
// joined, along with the endpoints it could adopt.
//
// The agent should then reconcile against its own records (etcd): Attach
// every local pod it knows (cheap and idempotent for an adopted endpoint)
// and Detach returned endpoints it has no pod for.
func (d *Datapath) Adopt() ([]Endpoint, error) {
	if err := d.lock(); err != nil {
		return nil, err
	}
	defer d.mu.Unlock()

	eps, err := d.endpoints()
	if err != nil {
		return nil, err
	}
	pinned, err := d.pinnedLinks()
	if err != nil {
		return nil, err
	}
	all := maps.Clone(pinned)
	for ifindex := range eps {
		all[ifindex] = true
	}

	var (
		out  []Endpoint
		errs []error
	)
	for _, ifindex := range slices.Sorted(maps.Keys(all)) {
		ep := eps[ifindex]
		kept, err := d.adoptOne(ifindex, ep, pinned[ifindex])
		if err != nil {
			errs = append(errs, fmt.Errorf("adopt ifindex %d: %w", ifindex, err))
		}
		if kept {
			out = append(out, *ep)
		}
	}
	if err := d.dropStaleCounters(); err != nil {
		errs = append(errs, err)
	}
	if err := d.dropStaleWatches(out); err != nil {
		errs = append(errs, err)
	}
	if err := d.dropStalePorts(out); err != nil {
		errs = append(errs, err)
	}
	slices.SortFunc(out, func(a, b Endpoint) int { return int(a.ID) - int(b.ID) })
	d.log.Info("adopted endpoints", "count", len(out), "errors", len(errs))
	return out, errors.Join(errs...)
}

// adoptOne handles one host interface; ep is nil when the maps hold only
// addresses, or nothing, for it. It reports whether ep stays attached.
func (d *Datapath) adoptOne(ifindex uint32, ep *Endpoint, pinned bool) (bool, error) {
	if pinned {
		return d.adoptTCX(ifindex, ep)
	}
	if ep == nil || ep.ID == 0 {
		d.log.Warn("removing addresses without an endpoint", "ifindex", ifindex)
		return false, d.removeEndpoint(ifindex, 0)
	}
	if _, err := netlink.LinkByIndex(int(ifindex)); err != nil {
		if !errors.As(err, new(netlink.LinkNotFoundError)) {
			return false, fmt.Errorf("find link: %w", err)
		}
		d.log.Info("interface gone, removing endpoint", "id", ep.ID, "ifindex", ifindex)
		return false, d.removeEndpoint(ifindex, ep.ID)
	}
	f, err := findTCFilter(int(ifindex))
	if err != nil {
		return false, err
	}
	if f != nil {
		// Attached with a clsact filter: keep it (replaced in place if the
		// program differs).
		return true, d.attachTC(int(ifindex))
	}
	d.log.Warn("endpoint was not attached, attaching it", "id", ep.ID, "ifindex", ifindex)
	if err := d.attachProgram(int(ifindex), ""); err != nil {
		return false, err
	}
	return true, nil
}

func (d *Datapath) adoptTCX(ifindex uint32, ep *Endpoint) (bool, error) {
	l, err := link.LoadPinnedLink(d.linkPin(int(ifindex)), nil)
	if err != nil {
		return false, fmt.Errorf("load pinned tcx link: %w", err)
	}
	defer l.Close()
	if ep == nil || ep.ID == 0 {
		// With no endpoint the program drops everything on this interface.
		d.log.Warn("detaching tcx link without an endpoint", "ifindex", ifindex)
		return false, d.dropEndpoint(ifindex, 0)
	}
	live, err := d.refreshLink(l, int(ifindex))
	if err != nil || live {
		return live, err
	}
	d.log.Info("interface gone, removing endpoint", "id", ep.ID, "ifindex", ifindex)
	return false, d.dropEndpoint(ifindex, ep.ID)
}

// dropEndpoint detaches the program from ifindex and removes its entries.
func (d *Datapath) dropEndpoint(ifindex uint32, id uint32) error {
	if err := d.detachProgram(int(ifindex)); err != nil {
		return err
	}
	return d.removeEndpoint(ifindex, id)
}

// endpoints reads the ifaces and addrs maps back into endpoints by ifindex.
// An ifindex with addresses but no ifaces entry maps to an Endpoint with ID 0.
func (d *Datapath) endpoints() (map[uint32]*Endpoint, error) {
	out := make(map[uint32]*Endpoint)
	var (
		ifindex uint32
		info    kvipamIfaceInfo
	)
	it := d.objs.KvipamIfaces.Iterate()
	for it.Next(&ifindex, &info) {
		ep := endpointOf(ifindex, info)
		out[ifindex] = &ep
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate ifaces: %w", err)
	}
	for ifindex, ips := range d.addrsByIfindex() {
		ep, ok := out[ifindex]
		if !ok {
			ep = &Endpoint{HostIfIndex: int(ifindex)}
			out[ifindex] = ep
		}
		slices.SortFunc(ips, netip.Addr.Compare)
		ep.IPs = ips
	}
	return out, nil
}

// pinnedLinks lists the ifindexes that have a pin under links/.
func (d *Datapath) pinnedLinks() (map[uint32]bool, error) {
	dir := filepath.Join(d.pinDir, linksDir)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read links dir: %w", err)
	}
	out := make(map[uint32]bool, len(entries))
	for _, e := range entries {
		n, err := strconv.ParseUint(e.Name(), 10, 31)
		if err != nil || n == 0 {
			d.log.Warn("ignoring unexpected pin", "path", filepath.Join(dir, e.Name()))
			continue
		}
		out[uint32(n)] = true
	}
	return out, nil
}

// dropStaleCounters deletes counters of endpoint IDs no interface uses.
func (d *Datapath) dropStaleCounters() error {
	var (
		id     uint32
		ids    []uint32
		percpu []kvipamCounters
	)
	it := d.objs.KvipamCounters.Iterate()
	for it.Next(&id, &percpu) {
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate counters: %w", err)
	}
	return d.dropUnusedCounters(ids...)
}
