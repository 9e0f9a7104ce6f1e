package nodealloc

import (
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// Every allocation and every release is one structured log line with the
// same fields as an IP history record, so that a site with a log pipeline
// can keep history for as long as it likes. The logger is named
// "allocator.ip".

// logAllocated logs the start of al's ownership interval.
func (a *Allocator) logAllocated(al *records.Allocation) {
	a.events.Info("ip allocated", "pool", al.Pool, "ip", al.Addr, "state", al.State,
		"container", al.ContainerID, "ifname", al.IfName, "namespace", al.Namespace, "pod", al.Pod, "pod_uid", al.PodUID,
		"network", al.Network, "node", al.Node, "start", al.Since)
}

// logEnded logs the end of al's ownership interval: released, or a
// reservation that lapsed.
func (a *Allocator) logEnded(al *records.Allocation, how string) {
	a.events.Info("ip "+how, "pool", al.Pool, "ip", al.Addr, "state", al.State,
		"container", al.ContainerID, "ifname", al.IfName, "namespace", al.Namespace, "pod", al.Pod, "pod_uid", al.PodUID,
		"network", al.Network, "node", al.Node, "start", al.Since, "end", a.cfg.Now().UTC().Format(time.RFC3339Nano))
}

// logReasserted logs an allocation written back after the store lost it
// (etcd restored from an older snapshot): the interval goes on.
func (a *Allocator) logReasserted(al *records.Allocation) {
	a.events.Warn("ip re-asserted", "pool", al.Pool, "ip", al.Addr, "state", al.State,
		"container", al.ContainerID, "ifname", al.IfName, "namespace", al.Namespace, "pod", al.Pod, "pod_uid", al.PodUID,
		"network", al.Network, "node", al.Node, "start", al.Since)
}
