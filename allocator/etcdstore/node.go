package etcdstore

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// NodeRecord is the value of NodeKey: who a node is while it is alive. It
// is written on the node's lease, so it disappears when the agent has been
// gone for longer than the TTL. Its absence is not proof that the node is
// gone (a node cut off from etcd loses it too), which is why kvipamctl node
// remove also wants the operator's statement.
type NodeRecord struct {
	Name    string `json:"name"`
	BootID  string `json:"bootID,omitempty"`
	Version string `json:"version,omitempty"`
	// Features are the schema features the agent understands
	// (allocator/schema); none from v0.1.0, which predates them.
	Features  []string `json:"features,omitempty"`
	Addresses []string `json:"addresses,omitempty"`
	// Labels are the node's labels (--node-labels), which pools' node
	// selectors choose by: kvipamctl pool show lists the live nodes a
	// pool serves from them.
	Labels    map[string]string `json:"labels,omitempty"`
	StartedAt time.Time         `json:"startedAt"`
	Lease     int64             `json:"lease"`
	// Revision is the revision the record was last written at, as etcd
	// holds it (not stored): set by the readers that give Lease as the
	// lease the key is on (ReadNode, WatchNode, NodeTakenError's Holder).
	Revision int64 `json:"-"`
	// LostEndpoints are the endpoints this agent found, since it started,
	// whose owner no longer held their addresses after a restore: the
	// node's blocks were freed while it was away. kvipamctl check reports
	// each one.
	LostEndpoints []LostEndpoint `json:"lostEndpoints,omitempty"`
	// Unknown keeps the members a newer version wrote that this one
	// does not know, so that a rewrite keeps them (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// LostEndpoint is a pod endpoint of a node whose addresses its owner no
// longer holds in etcd when the node comes back (its blocks were freed
// with kvipamctl node remove while it was down or cut off). The node never
// takes such an address back; the pod may still exist without working
// networking while another pod uses the address.
type LostEndpoint struct {
	// Owner is the endpoint's containerID/ifName.
	Owner     string `json:"owner"`
	Namespace string `json:"namespace,omitempty"`
	Pod       string `json:"pod,omitempty"`
	// IPs are the endpoint's addresses its owner no longer holds.
	IPs []LostIP `json:"ips"`
	// Kept is set when the owner still holds some of the endpoint's
	// addresses, so the endpoint was kept; otherwise it was torn down.
	Kept    bool      `json:"kept,omitempty"`
	FoundAt time.Time `json:"foundAt"`
	// Reason says how it was found: empty when the node came back to
	// find its blocks freed (node remove); otherwise why an allocation
	// etcd had lost could not be written back (reassert).
	Reason string `json:"reason,omitempty"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// LostIP is one lost address and who holds it now.
type LostIP struct {
	IP   string `json:"ip"`
	Pool string `json:"pool,omitempty"`
	// HeldBy is the owner (containerID/ifName) holding the address now,
	// and HeldByNode the node its allocation names; both empty when the
	// address is free, or when Unknown.
	HeldBy     string `json:"heldBy,omitempty"`
	HeldByNode string `json:"heldByNode,omitempty"`
	// Unknown is set when the holder could not be read.
	Unknown bool `json:"unknown,omitempty"`
	// Extra: members this version does not know (jsonkeep; not embedded,
	// as the name Unknown is taken).
	Extra jsonkeep.Unknown `json:"-"`
}

// Holder describes who holds the address now, for people: an owner and
// its node, "nobody", or "unknown".
func (ip LostIP) Holder() string {
	switch {
	case ip.Unknown:
		return "unknown"
	case ip.HeldBy == "":
		return "nobody"
	case ip.HeldByNode == "":
		return ip.HeldBy
	default:
		return ip.HeldBy + " on " + ip.HeldByNode
	}
}

// ListNodes reads the live nodes' records (a node's record goes with its
// lease), sorted by name.
func (s *Store) ListNodes(ctx context.Context) ([]NodeRecord, error) {
	out, _, err := s.liveNodes(ctx)
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b NodeRecord) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// ServingNodes names the nodes of nodes that p gives new addresses to:
// none if p is disabled, else those whose labels its node selector
// chooses. Given the live nodes' records, it is who serves p now.
func ServingNodes(p allocator.Pool, nodes []NodeRecord) []string {
	out := []string{}
	if p.Disabled {
		return out
	}
	for _, n := range nodes {
		if p.Selects(n.Labels) {
			out = append(out, n.Name)
		}
	}
	slices.Sort(out)
	return out
}
