package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
)

// bpfDatapath enforces each endpoint with kvipam's eBPF program on its
// host veth: packets from the pod whose source is not one of its
// addresses are dropped and counted. Links and maps are pinned, so the
// programs keep enforcing while the agent restarts, and Adopt takes them
// over without a gap.
type bpfDatapath struct {
	dp    *bpf.Datapath
	nl    *netlink.Handle
	netns string
	// auto: attach with a clsact filter unless the pod's egress is limited
	// (a chained bandwidth plugin then adds an ingress qdisc, which clsact
	// would exclude): with TCX.
	auto bool
	log  hclog.Logger
}

var _ Datapath = (*bpfDatapath)(nil)

// newBPFDatapath opens the eBPF datapath, or says why the kernel cannot
// run it (auto mode then falls back to routes).
func newBPFDatapath(pinDir, attach, netnsPath string, log hclog.Logger) (*bpfDatapath, error) {
	if err := bpf.Supported(); err != nil {
		return nil, fmt.Errorf("kernel cannot run the eBPF datapath: %w", err)
	}
	if err := ensureBPFFS(pinDir); err != nil {
		return nil, err
	}
	nl, err := netlinkns.Open(netnsPath)
	if err != nil {
		return nil, err
	}
	d, err := bpf.Open(pinDir, log.Named("bpf"))
	if err != nil {
		nl.Close()
		return nil, fmt.Errorf("open eBPF datapath in %s: %w", pinDir, err)
	}
	mode := attach
	if attach == BPFAttachAuto {
		mode = bpf.AttachTC
	}
	if err := d.SetAttachMode(mode); err != nil {
		nl.Close()
		return nil, errors.Join(err, d.Close())
	}
	return &bpfDatapath{dp: d, nl: nl, netns: netnsPath, auto: attach == BPFAttachAuto, log: log}, nil
}

// serveHostPorts attaches the host port programs to lo and the uplinks.
// Without them pods' host ports are still served to the node's pods; the
// error is logged, not fatal, so that the node keeps running pods.
func (d *bpfDatapath) serveHostPorts(cfg Config, log hclog.Logger) {
	uplinks, err := hostPortUplinks(cfg.HostPortDevices, cfg.NodeAddresses, d.netns, log)
	if err == nil {
		err = d.inNetns(func() error { return d.dp.AttachHostPorts(uplinks) })
	}
	if err != nil {
		log.Error("host ports are not served to other hosts or the node itself", "error", err)
		return
	}
	log.Info("host ports served", "uplinks", uplinks)
}

// ensureBPFFS mounts bpffs on /sys/fs/bpf when the pin directory lives
// there and nothing is mounted yet (some hosts do not mount it at boot).
func ensureBPFFS(pinDir string) error {
	const root = "/sys/fs/bpf"
	if !strings.HasPrefix(filepath.Clean(pinDir)+"/", root+"/") {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err == nil && st.Type == unix.BPF_FS_MAGIC {
		return nil
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", root, err)
	}
	if err := unix.Mount("bpffs", root, "bpf", 0, ""); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", root, err)
	}
	return nil
}

func (d *bpfDatapath) Name() string { return DatapathBPF }

// inNetns runs fn in the pod interfaces' namespace: the kernel resolves
// the interface index of a TCX attach in the caller's namespace.
func (d *bpfDatapath) inNetns(fn func() error) error {
	if d.netns == "" {
		return fn()
	}
	return ns.WithNetNSPath(d.netns, func(ns.NetNS) error { return fn() })
}

func (d *bpfDatapath) toBPF(ep api.Endpoint) (bpf.Endpoint, error) {
	out := bpf.Endpoint{ID: ep.ID, HostIfIndex: ep.HostIfIndex, HostIfName: ep.HostIfName}
	if d.auto && ep.EgressLimited {
		out.Attach = bpf.AttachTCX
	}
	if ep.ContainerMAC != "" {
		mac, err := net.ParseMAC(ep.ContainerMAC)
		if err != nil {
			return out, fmt.Errorf("container MAC %q: %w", ep.ContainerMAC, err)
		}
		out.MAC = mac
	}
	for _, a := range ep.IPs {
		if !a.IsValid() {
			return out, fmt.Errorf("endpoint %d has an invalid address", ep.ID)
		}
		out.IPs = append(out.IPs, a)
	}
	ports, err := bpfPorts(ep.PortMappings, out.IPs)
	if err != nil {
		return out, err
	}
	out.Ports = ports
	return out, nil
}

func (d *bpfDatapath) Setup(_ context.Context, ep *api.Endpoint) error {
	l, err := d.nl.LinkByName(ep.HostIfName)
	if err != nil {
		return fmt.Errorf("find host interface %q: %w", ep.HostIfName, err)
	}
	ep.HostIfIndex = l.Attrs().Index
	bep, err := d.toBPF(*ep)
	if err != nil {
		return err
	}
	bep.HostMAC = l.Attrs().HardwareAddr
	return d.inNetns(func() error { return d.dp.Attach(bep) })
}

func (d *bpfDatapath) Teardown(_ context.Context, ep api.Endpoint) error {
	if ep.HostIfIndex == 0 {
		return nil // never attached
	}
	bep, err := d.toBPF(ep)
	if err != nil {
		return err
	}
	return d.inNetns(func() error { return d.dp.Detach(bep) })
}

// Retire removes ep's map entries and keeps the program attached: it
// drops everything on the veth until the veth is deleted.
func (d *bpfDatapath) Retire(_ context.Context, ep api.Endpoint) error {
	if ep.HostIfIndex == 0 {
		return nil // never attached
	}
	return d.dp.Disarm(bpf.Endpoint{ID: ep.ID, HostIfIndex: ep.HostIfIndex})
}

// Forget unpins a retired endpoint's TCX link once its veth is gone.
func (d *bpfDatapath) Forget(ep api.Endpoint) error {
	if ep.HostIfIndex == 0 {
		return nil
	}
	return d.inNetns(func() error { return d.dp.Forget(ep.HostIfIndex) })
}

// Adopt keeps every pinned attachment that belongs to a known endpoint
// (no detach, so no gap), attaches known endpoints the pins lack (a crash
// between the record and the attach), and detaches pinned endpoints the
// agent has no record of.
func (d *bpfDatapath) Adopt(_ context.Context, eps []api.Endpoint) error {
	var found []bpf.Endpoint
	if err := d.inNetns(func() error {
		var err error
		found, err = d.dp.Adopt()
		return err
	}); err != nil {
		return err
	}
	pinned := map[int]bpf.Endpoint{}
	for _, f := range found {
		pinned[f.HostIfIndex] = f
	}
	var errs []error
	for _, ep := range eps {
		if f, ok := pinned[ep.HostIfIndex]; ok && f.ID == ep.ID {
			delete(pinned, ep.HostIfIndex)
			continue
		}
		epc := ep
		err := d.Setup(context.Background(), &epc)
		var nf netlink.LinkNotFoundError
		switch {
		case errors.As(err, &nf):
			// The pod's veth went while the agent was down (netns deleted
			// without DEL): nothing to enforce; the reconciler releases
			// its IPs after the grace period.
			d.log.Warn("endpoint's host interface is gone; not re-attaching", "id", ep.ID, "host_if", ep.HostIfName)
		case err != nil:
			errs = append(errs, fmt.Errorf("re-attach endpoint %d: %w", ep.ID, err))
		}
		delete(pinned, epc.HostIfIndex)
	}
	for _, stale := range pinned {
		d.log.Info("detaching a pinned endpoint the agent has no record of", "ifindex", stale.HostIfIndex, "id", stale.ID)
		if err := d.inNetns(func() error { return d.dp.Detach(stale) }); err != nil {
			errs = append(errs, err)
		}
	}
	d.log.Info("adopted pinned eBPF endpoints", "kept", len(found)-len(pinned), "records", len(eps))
	return errors.Join(errs...)
}

func (d *bpfDatapath) HostLinkExists(ep api.Endpoint) (bool, error) {
	return hostLinkExists(d.nl, ep)
}

func (d *bpfDatapath) Counters() (map[uint32]api.Counters, error) {
	st, err := d.dp.Stats()
	if err != nil {
		return nil, err
	}
	out := make(map[uint32]api.Counters, len(st))
	for id, c := range st {
		out[id] = api.Counters{PassedPackets: c.PassedPackets, PassedBytes: c.PassedBytes, DroppedPackets: c.DroppedPackets, DroppedBytes: c.DroppedBytes}
	}
	return out, nil
}

// Close closes handles only: the pinned programs keep enforcing.
func (d *bpfDatapath) Close() error {
	d.nl.Close()
	return d.dp.Close()
}
