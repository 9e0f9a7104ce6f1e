package inspect

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// Errors of the planners. Compare with errors.Is.
var (
	// ErrNodeAlive refuses a plan that would take addresses or blocks from
	// a node whose node record exists, unless forced. (A node without one
	// needs Evidence instead.)
	ErrNodeAlive = errors.New("inspect: node is alive")
	// ErrBadRequest is a request that names nothing to plan for.
	ErrBadRequest = errors.New("inspect: bad request")
	// ErrAmbiguous is a request that matches more than intended, such as
	// an address allocated in two pools when no pool was named.
	ErrAmbiguous = errors.New("inspect: ambiguous request")
)

// StepKind is the kind of record a step deletes (or, StepAlternate,
// rewrites).
type StepKind string

// Kinds of records a plan deletes.
const (
	StepIP    StepKind = "ip"
	StepClaim StepKind = "claim"
	StepHome  StepKind = "home"
	// StepBinding deletes a sticky identity's binding to addresses the
	// plan releases.
	StepBinding StepKind = "binding"
	// StepAlternate ends a live migration whose second owner runs on the
	// removed node: Key is the binding, which loses its alternate, as do
	// the address records of Rewrite (alternatesteps.go).
	StepAlternate StepKind = "alternate"
)

// Guard is a condition a step's delete is fenced by, checked in the same
// transaction (etcdstore runs it): Key absent (Rev 0), Key unchanged at
// Rev, or (Prefix) no key at all under Key.
type Guard = etcdstore.Guard

// Step deletes one key, only if it still has revision Rev and its guards
// hold.
type Step struct {
	Kind   StepKind     `json:"kind"`
	Key    string       `json:"key"`
	Rev    int64        `json:"rev"`
	Pool   string       `json:"pool"`
	Block  netip.Prefix `json:"block"`
	Addr   netip.Addr   `json:"ip,omitzero"`
	Node   string       `json:"node,omitempty"`
	Owner  string       `json:"owner,omitempty"`
	Reason string       `json:"reason"`
	Guards []Guard      `json:"guards,omitempty"`
	// Group ties the steps that free one block: when one fails, the later
	// ones of its group are skipped. Empty: the step stands alone.
	Group string `json:"group,omitempty"`
	// History, for an allocation, is the ownership interval the delete
	// ends; Execute writes it to IP history in the delete's transaction,
	// with the execution time as its end.
	History *etcdstore.HistoryRecord `json:"history,omitempty"`
	// Also are keys deleted with Key: a borrowed address's home.
	Also []string `json:"also,omitempty"`
	// Rewrite, for StepAlternate, are the address records that lose the
	// alternate with the binding, each only if still at its revision.
	Rewrite []Guard `json:"rewrite,omitempty"`
}

// Plan is the list of deletes a repair makes, as seen at Revision.
type Plan struct {
	Action   string `json:"action"`
	Revision int64  `json:"revision"`
	Force    bool   `json:"force"`
	// Evidence is the operator's statement that the node is gone, for a
	// node remove or a release of addresses of a node that is not live;
	// nil for other plans.
	Evidence *Evidence `json:"evidence,omitempty"`
	Steps    []Step    `json:"steps"`
}

// ipStep deletes one allocation. Unless forced it is fenced by "the node
// named in the record is still gone", so a node that comes back between
// plan and execution keeps its address.
func ipStep(ip *IP, reason, ended string, force bool, guards ...Guard) Step {
	rec := etcdstore.HistoryOf(records.Allocation{Record: ip.Record, Pool: ip.Pool, Block: ip.Block, Addr: ip.Addr}, time.Time{}, ended)
	st := Step{Kind: StepIP, Key: ip.Key, Rev: ip.Rev, Pool: ip.Pool, Block: ip.Block, Addr: ip.Addr,
		Node: ip.Node, Owner: ip.Owner.Key(), Reason: reason, Guards: guards, History: &rec}
	if !force {
		st.Guards = append(st.Guards, Guard{Key: etcdstore.NodeKey(ip.Node)})
	}
	if ip.Borrowed {
		st.Also = []string{etcdstore.LentKey(ip.Pool, ip.Addr)}
	}
	return st
}

// refuseLive returns ErrNodeAlive naming the live nodes among nodes,
// unless forced.
func refuseLive(s *Snapshot, force bool, nodes ...string) error {
	if force {
		return nil
	}
	var live []string
	for _, n := range nodes {
		if _, ok := s.Nodes[n]; ok && !slices.Contains(live, n) {
			live = append(live, n)
		}
	}
	if len(live) == 0 {
		return nil
	}
	slices.Sort(live)
	return fmt.Errorf("%w: %s has a node record, so its agent may still use these addresses",
		ErrNodeAlive, strings.Join(live, ", "))
}

// refuseLiveAlternates refuses, unless forced, the release of an address
// whose live migration's second owner is on a live node: its pod runs on
// the address, and would lose it. The migration is cut over to it first.
func refuseLiveAlternates(s *Snapshot, force bool, ips []*IP) error {
	if force {
		return nil
	}
	var held []string
	for _, ip := range ips {
		if alt := ip.Alternate; alt != nil {
			if _, live := s.Nodes[alt.Node]; live {
				held = append(held, fmt.Sprintf("%s (sticky identity %s: its second owner %s runs on node %s)", ip.Addr, ip.Identity, alt.Owner.Key(), alt.Node))
			}
		}
	}
	if len(held) == 0 {
		return nil
	}
	return fmt.Errorf("%w: a live migration's target holds %s: cut it over first (kvipamctl ip migrate NAMESPACE/NAME --cut-over), or --force",
		ErrNodeAlive, strings.Join(held, ", "))
}

// planIPs plans the release of the allocations matching keep. Their nodes
// must be gone: a live one (a node record) is refused unless forced, and
// one that is not live needs ev, the operator's statement that it is gone
// (see PlanNodeRemove: a node cut off from etcd has no node record either,
// while its pods use their addresses), whether forced or not.
func planIPs(s *Snapshot, action, reason string, ev Evidence, force bool, keep func(*IP) bool, scope func(records.Binding) bool) (Plan, error) {
	p := Plan{Action: action, Revision: s.Revision, Force: force, Steps: []Step{}}
	var nodes []string
	var released []*IP
	for i := range s.IPs {
		if ip := &s.IPs[i]; keep(ip) {
			p.Steps = append(p.Steps, ipStep(ip, reason, etcdstore.EndOperatorRelease, force))
			nodes = append(nodes, ip.Node)
			released = append(released, ip)
		}
	}
	if err := refuseLive(s, force, nodes...); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	if err := refuseLiveAlternates(s, force, released); err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	gone, err := requireEvidence(s, ev, nodes)
	if err != nil {
		return Plan{}, fmt.Errorf("plan %s: %w", action, err)
	}
	if gone {
		p.Evidence = &ev
	}
	p.Steps = withBindings(s, p.Steps, scope, force, func(ip *IP) Step {
		return ipStep(ip, "address of sticky identity "+ip.Identity+", whose binding "+action+" releases", etcdstore.EndOperatorRelease, force)
	})
	return p, nil
}

// requireEvidence checks ev against the nodes among nodes that have no
// node record, and reports whether there were any. Evidence names one
// node, so addresses of several such nodes are refused: release them node
// by node. A record that names no node has no node to state anything of.
func requireEvidence(s *Snapshot, ev Evidence, nodes []string) (bool, error) {
	var gone []string
	for _, n := range nodes {
		if _, live := s.Nodes[n]; !live && n != "" && !slices.Contains(gone, n) {
			gone = append(gone, n)
		}
	}
	switch len(gone) {
	case 0:
		return false, nil
	case 1:
		return true, checkEvidence(s, gone[0], ev)
	}
	slices.Sort(gone)
	return true, fmt.Errorf("%w: the addresses belong to %d nodes without a node record (%s), and evidence names one node: release them node by node",
		ErrNoEvidence, len(gone), strings.Join(gone, ", "))
}

// PlanReleaseIP plans the release of addr in pool, or in whichever pool
// holds it when pool is "" (ErrAmbiguous if several do). Every key holding
// the address is released, for a duplicated address the legitimate one
// too. An address that is not allocated gives an empty plan. ev and force
// are as for planIPs.
func PlanReleaseIP(s *Snapshot, pool string, addr netip.Addr, ev Evidence, force bool) (Plan, error) {
	if !addr.IsValid() {
		return Plan{}, fmt.Errorf("plan release: %w: no address", ErrBadRequest)
	}
	addr = addr.Unmap()
	var pools []string
	for _, ip := range s.IPs {
		if ip.Addr.Unmap() == addr && (pool == "" || ip.Pool == pool) && !slices.Contains(pools, ip.Pool) {
			pools = append(pools, ip.Pool)
		}
	}
	if len(pools) > 1 {
		return Plan{}, fmt.Errorf("plan release of %s: %w: allocated in pools %s, name one", addr, ErrAmbiguous, strings.Join(pools, ", "))
	}
	action := "release ip " + addr.String()
	if pool != "" {
		action += " in pool " + pool
	}
	return planIPs(s, action, "released by operator", ev, force, func(ip *IP) bool {
		return ip.Addr.Unmap() == addr && (pool == "" || ip.Pool == pool)
	}, func(b records.Binding) bool { return slices.Contains(b.Addrs, addr) })
}

// PlanReleaseOwner plans the release of every address of a container, in
// every pool, or of one interface when ifName is not "". ev and force are
// as for planIPs.
func PlanReleaseOwner(s *Snapshot, containerID, ifName string, ev Evidence, force bool) (Plan, error) {
	if containerID == "" {
		return Plan{}, fmt.Errorf("plan release: %w: empty container ID", ErrBadRequest)
	}
	action := "release owner " + containerID
	if ifName != "" {
		action += "/" + ifName
	}
	return planIPs(s, action, "released by operator", ev, force, func(ip *IP) bool {
		return ip.ContainerID == containerID && (ifName == "" || ip.IfName == ifName)
	}, func(b records.Binding) bool {
		return b.Owner.ContainerID == containerID && (ifName == "" || b.Owner.IfName == ifName)
	})
}

// PlanReleaseNode plans the release of every address whose record names
// node, wherever it sits. The node's blocks keep their homes; once empty
// they are free to claim (kvipamctl node remove also deletes the homes).
// ev and force are as for planIPs.
func PlanReleaseNode(s *Snapshot, node string, ev Evidence, force bool) (Plan, error) {
	if node == "" {
		return Plan{}, fmt.Errorf("plan release: %w: empty node name", ErrBadRequest)
	}
	return planIPs(s, "release node "+node, "released with node "+node, ev, force, func(ip *IP) bool {
		return ip.Node == node
	}, func(b records.Binding) bool { return b.Node == node })
}
