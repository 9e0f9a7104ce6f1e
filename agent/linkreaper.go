package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
)

// reapGroup is the link group of host veths retired by a DEL and waiting
// to be deleted. Membership is kernel state, so a veth retired just
// before the agent died is still found, and deleted, at its start.
const reapGroup = api.ReapLinkGroup

// linkReaper takes a host veth off a DEL's path. The kernel's
// unregistration of a veth takes tens of milliseconds, mostly RCU grace
// periods, and deleting many veths in one operation shares them; so a DEL
// only retires its veth (retire: into the reap group, routes deleted),
// and the reaper deletes the whole group at once in the
// background. The address is released only after retire, so it is never
// handed out while a route to its old interface exists; the datapath
// drops the retired veth's traffic until it is gone (Datapath.Retire).
type linkReaper struct {
	nl    *netlink.Handle
	netns string // the host veths' namespace, "" for the agent's own
	// dp forgets each retired endpoint once its veth is deleted.
	dp  interface{ Forget(ep api.Endpoint) error }
	log hclog.Logger

	kick    chan struct{}
	mu      sync.Mutex
	retired []api.Endpoint // waiting for forget
}

// newLinkReaper takes h for its own: it turns on the kernel's strict
// checking of h's dump requests, so that listing a veth's routes makes the
// kernel filter by interface instead of sending the whole table (with a
// hundred pods, that listing was a fifth of a DEL's work in the agent).
// Results do not depend on it: netlink filters again on our side, also
// on a kernel without strict checks (before 4.20).
func newLinkReaper(h *netlink.Handle, netnsPath string, dp interface{ Forget(api.Endpoint) error }, log hclog.Logger) *linkReaper {
	if err := h.SetStrictCheck(true); err != nil {
		log.Debug("netlink strict checks unavailable; route listings filtered here", "error", err)
	}
	return &linkReaper{nl: h, netns: netnsPath, dp: dp, log: log, kick: make(chan struct{}, 1)}
}

// retire readies the host veth name for deletion and returns its ifindex,
// or 0 when there is no such interface. Retiring a retired veth again
// succeeds. Anything but a kvipam host veth is refused.
func (r *linkReaper) retire(name string) (int, error) {
	if !strings.HasPrefix(name, api.HostVethPrefix) {
		return 0, &FieldError{Field: "hostIfName", Msg: fmt.Sprintf("%q is not a kvipam host veth (prefix %q)", name, api.HostVethPrefix)}
	}
	l, err := r.nl.LinkByName(name)
	if errors.As(err, new(netlink.LinkNotFoundError)) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("find host veth %s: %w", name, err)
	}
	if _, ok := l.(*netlink.Veth); !ok {
		return 0, &FieldError{Field: "hostIfName", Msg: fmt.Sprintf("%s is a %s, not a veth", name, l.Type())}
	}
	// The group first: from here a crash still ends in deletion. From
	// here too the reaper may delete the veth at any moment (another DEL
	// woke it), which retires it as well as anything: "no such device"
	// is success.
	ifindex := l.Attrs().Index
	if err := r.nl.LinkSetGroup(l, reapGroup); err != nil {
		return 0, fmt.Errorf("retire host veth %s: set link group: %w", name, err)
	}
	routes, err := netlinksafe.Handle{Handle: r.nl}.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: ifindex}, netlink.RT_FILTER_OIF)
	if gone(err) {
		return ifindex, nil
	}
	if err != nil {
		return 0, fmt.Errorf("retire host veth %s: list routes: %w", name, err)
	}
	for _, rt := range routes {
		if err := r.nl.RouteDel(&rt); err != nil && !errors.Is(err, unix.ESRCH) && !gone(err) {
			return 0, fmt.Errorf("retire host veth %s: delete route %s: %w", name, rt.Dst, err)
		}
	}
	r.wake()
	return ifindex, nil
}

// gone reports whether err says the interface no longer exists.
func gone(err error) bool {
	return errors.Is(err, unix.ENODEV) || errors.As(err, new(netlink.LinkNotFoundError))
}

// retiredEndpoint hands the reaper an endpoint whose veth was retired,
// for forget once the veth is gone.
func (r *linkReaper) retiredEndpoint(ep api.Endpoint) {
	r.mu.Lock()
	r.retired = append(r.retired, ep)
	r.mu.Unlock()
	r.wake()
}

func (r *linkReaper) wake() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// run deletes the reap group whenever something was retired, until ctx
// ends. Veths retired while a deletion runs go together in the next one.
func (r *linkReaper) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
		}
		if err := r.reap(); err != nil {
			r.log.Warn("deleting retired host veths failed; retrying at the next DEL or start", "error", err)
		}
	}
}

// reap deletes every retired veth in one netlink operation, then forgets
// the endpoints retired before it.
func (r *linkReaper) reap() error {
	r.mu.Lock()
	eps := r.retired
	r.retired = nil
	r.mu.Unlock()
	if err := r.deleteGroup(); err != nil {
		r.mu.Lock()
		r.retired = append(eps, r.retired...)
		r.mu.Unlock()
		return err
	}
	var errs []error
	for _, ep := range eps {
		if err := r.dp.Forget(ep); err != nil {
			errs = append(errs, fmt.Errorf("forget endpoint %d (%s): %w", ep.ID, ep.HostIfName, err))
		}
	}
	r.log.Debug("retired host veths deleted", "endpoints", len(eps))
	return errors.Join(errs...)
}

// deleteGroup is `ip link del group reapGroup` in the veths' namespace:
// the kernel unregisters every member, and each veth's peer, together.
// An empty group is no error.
func (r *linkReaper) deleteGroup() error {
	del := func() error {
		req := nl.NewNetlinkRequest(unix.RTM_DELLINK, unix.NLM_F_ACK)
		req.AddData(nl.NewIfInfomsg(unix.AF_UNSPEC))
		req.AddData(nl.NewRtAttr(unix.IFLA_GROUP, nl.Uint32Attr(reapGroup)))
		_, err := req.Execute(unix.NETLINK_ROUTE, 0)
		if errors.Is(err, unix.ENODEV) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("delete link group %#x: %w", reapGroup, err)
		}
		return nil
	}
	if r.netns == "" {
		return del()
	}
	return ns.WithNetNSPath(r.netns, func(ns.NetNS) error { return del() })
}
