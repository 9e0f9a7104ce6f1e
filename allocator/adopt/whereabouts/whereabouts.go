// Package whereabouts reads whereabouts' allocations (its IPPool and
// OverlappingRangeIPReservation objects, whereabouts.cni.cncf.io/v1alpha1,
// as of whereabouts v0.9.2) with the pods that hold them, from one List
// as `kubectl get ippools.whereabouts.cni.cncf.io,
// overlappingrangeipreservations.whereabouts.cni.cncf.io,pods -A -o json`
// prints it. An IPPool's allocations are keyed by their offset from the
// range's first address, as whereabouts writes them; each names its
// container ID, interface and pod ("namespace/name"), and the pod's
// spec.nodeName says the node. It only reads.
package whereabouts

import (
	"encoding/json"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/records"
)

// Group is whereabouts' API group.
const Group = "whereabouts.cni.cncf.io"

// IPPool is whereabouts' IPPool as far as an import reads it.
type IPPool struct {
	Kind     string `json:"kind"`
	Metadata Meta   `json:"metadata"`
	Spec     struct {
		Range       string                  `json:"range"`
		Allocations map[string]IPAllocation `json:"allocations"`
	} `json:"spec"`
}

// IPAllocation is one address of an IPPool.
type IPAllocation struct {
	ContainerID string `json:"id"`
	PodRef      string `json:"podref"`
	IfName      string `json:"ifname,omitempty"`
}

// Reservation is an OverlappingRangeIPReservation: named by the address
// (an IPv6 address with ':' written '-'), the cluster-wide owner of it.
type Reservation struct {
	Metadata Meta `json:"metadata"`
	Spec     struct {
		ContainerID string `json:"containerid,omitempty"`
		PodRef      string `json:"podref"`
		IfName      string `json:"ifname,omitempty"`
	} `json:"spec"`
}

// Meta is the object metadata read.
type Meta struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace,omitempty"`
}

type pod struct {
	Metadata struct {
		Name        string            `json:"name"`
		Namespace   string            `json:"namespace"`
		UID         string            `json:"uid"`
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	Spec struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
	Status struct {
		Phase  string `json:"phase"`
		PodIPs []struct {
			IP string `json:"ip"`
		} `json:"podIPs"`
	} `json:"status"`
}

// networkStatus is Multus' annotation naming every interface's addresses
// (a whereabouts network is most often a secondary one, not in podIPs).
const networkStatus = "k8s.v1.cni.cncf.io/network-status"

// liveAddrs is what the pod says it runs with: its podIPs and, through
// Multus' network-status annotation, its other interfaces' addresses.
func (p pod) liveAddrs() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out[a.Unmap()] = true
		}
	}
	var nets []struct {
		IPs []string `json:"ips"`
	}
	if raw := p.Metadata.Annotations[networkStatus]; raw != "" && json.Unmarshal([]byte(raw), &nets) == nil {
		for _, n := range nets {
			for _, ip := range n.IPs {
				if a, err := netip.ParseAddr(ip); err == nil {
					out[a.Unmap()] = true
				}
			}
		}
	}
	return out
}

type object struct {
	APIVersion string          `json:"apiVersion"`
	Kind       string          `json:"kind"`
	Raw        json.RawMessage `json:"-"`
}

// Export is what the List holds, by kind.
type Export struct {
	Pools        []IPPool
	Reservations []Reservation
	pods         map[string]pod // by namespace/name
}

// Parse reads a List (kind List, or any *List) of IPPools,
// OverlappingRangeIPReservations and Pods. An item of another kind is an
// error: the export was not made as documented.
func Parse(data []byte) (Export, error) {
	var list struct {
		Kind  string            `json:"kind"`
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(data, &list); err != nil {
		return Export{}, fmt.Errorf("%w: whereabouts export: %w", records.ErrBadRequest, err)
	}
	if !strings.HasSuffix(list.Kind, "List") {
		return Export{}, fmt.Errorf("%w: whereabouts export: kind %q, want a List (kubectl get ... -o json)", records.ErrBadRequest, list.Kind)
	}
	ex := Export{pods: map[string]pod{}}
	for i, raw := range list.Items {
		var o object
		if err := json.Unmarshal(raw, &o); err != nil {
			return Export{}, fmt.Errorf("%w: whereabouts export: item %d: %w", records.ErrBadRequest, i, err)
		}
		group, _, _ := strings.Cut(o.APIVersion, "/")
		var err error
		switch {
		case group == Group && o.Kind == "IPPool":
			var p IPPool
			err = json.Unmarshal(raw, &p)
			ex.Pools = append(ex.Pools, p)
		case group == Group && o.Kind == "OverlappingRangeIPReservation":
			var r Reservation
			err = json.Unmarshal(raw, &r)
			ex.Reservations = append(ex.Reservations, r)
		case o.APIVersion == "v1" && o.Kind == "Pod":
			var p pod
			err = json.Unmarshal(raw, &p)
			ex.pods[p.Metadata.Namespace+"/"+p.Metadata.Name] = p
		default:
			return Export{}, fmt.Errorf("%w: whereabouts export: item %d is %s %s: want IPPools, OverlappingRangeIPReservations and Pods", records.ErrBadRequest, i, o.APIVersion, o.Kind)
		}
		if err != nil {
			return Export{}, fmt.Errorf("%w: whereabouts export: item %d (%s): %w", records.ErrBadRequest, i, o.Kind, err)
		}
	}
	return ex, nil
}

// Skipped is an allocation of the source that is not imported, and why.
type Skipped struct {
	Pool   string     `json:"ippool"`
	Addr   netip.Addr `json:"ip,omitempty"`
	PodRef string     `json:"podref,omitempty"`
	Why    string     `json:"why"`
}

// Allocations turns ex into allocations, with the pods' nodes: from the
// IPPools named in pools (every one when empty). An allocation whose pod
// is not in the export, has no node, or has ended (Succeeded, Failed) is
// not live: skipped. One whose overlapping-range reservation names
// another pod is skipped as inconsistent. A malformed offset or range is
// an error.
func (ex Export) Allocations(pools []string) ([]adopt.Allocation, []Skipped, error) {
	var out []adopt.Allocation
	var skipped []Skipped
	// A pod's interface with more than one allocation: a pod re-created
	// under its name (a StatefulSet's) or whose earlier sandbox's DEL
	// never reached whereabouts. Only an address the pod says it runs
	// with is live.
	perIface := map[string]int{}
	for _, p := range ex.Pools {
		for _, al := range p.Spec.Allocations {
			perIface[al.PodRef+" "+al.IfName]++
		}
	}
	for _, p := range ex.Pools {
		if len(pools) > 0 && !slices.Contains(pools, p.Metadata.Name) {
			continue
		}
		first, err := firstAddr(p.Spec.Range)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: IPPool %s: %w", records.ErrBadRequest, p.Metadata.Name, err)
		}
		for off, al := range p.Spec.Allocations {
			addr, err := addOffset(first, off)
			if err != nil {
				return nil, nil, fmt.Errorf("%w: IPPool %s: allocation %q: %w", records.ErrBadRequest, p.Metadata.Name, off, err)
			}
			skip := func(why string) {
				skipped = append(skipped, Skipped{Pool: p.Metadata.Name, Addr: addr, PodRef: al.PodRef, Why: why})
			}
			ns, name, ok := strings.Cut(al.PodRef, "/")
			pd, found := ex.pods[al.PodRef]
			switch {
			case al.ContainerID == "" || al.IfName == "" || !ok:
				skip("no container ID, interface or pod reference (namespace/name)")
				continue
			case !found:
				skip("its pod is not in the export (gone: whereabouts leaked it)")
				continue
			case pd.Spec.NodeName == "":
				skip("its pod has no node")
				continue
			case pd.Status.Phase == "Succeeded" || pd.Status.Phase == "Failed":
				skip("its pod has ended (" + pd.Status.Phase + ")")
				continue
			}
			if perIface[al.PodRef+" "+al.IfName] > 1 && !pd.liveAddrs()[addr] {
				skip("another allocation names the same pod and interface, and the pod runs with another address (an earlier sandbox's, whose DEL never reached whereabouts)")
				continue
			}
			if r, ok := ex.reservation(addr); ok && (r.Spec.PodRef != al.PodRef || (r.Spec.ContainerID != "" && r.Spec.ContainerID != al.ContainerID)) {
				skip("its OverlappingRangeIPReservation names " + r.Spec.PodRef + " " + r.Spec.ContainerID)
				continue
			}
			out = append(out, adopt.Allocation{Addr: addr, Node: pd.Spec.NodeName, Owner: records.Owner{
				ContainerID: al.ContainerID, IfName: al.IfName, Namespace: ns, Pod: name, PodUID: pd.Metadata.UID}})
		}
	}
	slices.SortFunc(out, func(a, b adopt.Allocation) int { return a.Addr.Compare(b.Addr) })
	return out, skipped, nil
}

// reservation finds addr's OverlappingRangeIPReservation: named by the
// address with ':' written '-' (and "::" ending in "--0"), after the
// network's name and a '-' when the network has one (whereabouts'
// NormalizeIP).
func (ex Export) reservation(addr netip.Addr) (Reservation, bool) {
	s := addr.String()
	if strings.HasSuffix(s, ":") {
		s += "0"
	}
	norm := strings.ReplaceAll(s, ":", "-")
	for _, r := range ex.Reservations {
		if n := r.Metadata.Name; n == norm || strings.HasSuffix(n, "-"+norm) {
			return r, true
		}
	}
	return Reservation{}, false
}

// firstAddr is the address an IPPool's offsets count from: the range's
// address as written (whereabouts' ParseCIDR).
func firstAddr(rng string) (netip.Addr, error) {
	a, _, ok := strings.Cut(rng, "/")
	if !ok {
		return netip.Addr{}, fmt.Errorf("range %q is not a CIDR", rng)
	}
	if _, err := netip.ParsePrefix(rng); err != nil {
		return netip.Addr{}, fmt.Errorf("range %q: %w", rng, err)
	}
	return netip.ParseAddr(a)
}

// addOffset is first plus the decimal offset off, which must stay in
// first's family.
func addOffset(first netip.Addr, off string) (netip.Addr, error) {
	n, err := strconv.ParseUint(off, 10, 64)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("offset %q: %w", off, err)
	}
	b := first.AsSlice()
	sum := new(big.Int).Add(new(big.Int).SetBytes(b), new(big.Int).SetUint64(n))
	if sum.BitLen() > len(b)*8 {
		return netip.Addr{}, fmt.Errorf("offset %d past the end of the %d-bit address space from %s", n, len(b)*8, first)
	}
	out := make([]byte, len(b))
	sum.FillBytes(out)
	a, _ := netip.AddrFromSlice(out)
	return a, nil
}

// SourceID names an import of whereabouts into pool.
func SourceID(pool string) string { return "whereabouts:" + pool }
