// Package api is the kvipam agent's unix-socket API: JSON over HTTP with
// versioned paths. The CNI plugins and kvipamctl speak it through package
// agent/client; the agent serves it from package agent.
//
// Every error answer has a 4xx/5xx status and an Error body whose Code is
// one of the Code* constants, so callers map it without parsing messages.
//
// Addresses are netip.Addr and prefixes netip.Prefix, which marshal as
// their usual text ("10.0.0.5", "10.0.0.5/32"), so neither side parses
// strings. Decoding refuses a malformed address; request lists (Addrs,
// Prefixes) name the index of the one at fault.
package api

import (
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// Paths of the v1 API.
const (
	PathHealth    = "/v1/healthz"
	PathStatus    = "/v1/status"
	PathConfig    = "/v1/config"
	PathAllocate  = "/v1/allocate"
	PathRelease   = "/v1/release"
	PathEndpoints = "/v1/endpoints"
	PathGC        = "/v1/gc"
	// PathAllocations?containerID=&ifName= lists one owner's addresses.
	PathAllocations = "/v1/allocations"
)

// HeaderTimeout carries, in milliseconds, how long the caller waits for
// the answer (a plugin's agentTimeout). The agent bounds the request's work
// by it, less a margin for the answer's way back, instead of its own
// requestTimeout: an etcd slow to answer is retried inside the caller's
// deadline rather than answered "try again" early.
const HeaderTimeout = "Kvipam-Timeout-Ms"

// MaxBodyBytes bounds every request body; larger ones get 413.
const MaxBodyBytes = 1 << 20

// Error codes. CNI plugins map CodeTryAgain to CNI error 11 and
// CodeExhausted/CodeInUse/CodeDisabled/CodeNameTaken to plugin-specific
// codes.
const (
	CodeBadRequest = "bad_request" // 400: a field is wrong; Field names it
	CodeNotFound   = "not_found"   // 404
	CodeInUse      = "in_use"      // 409: a requested IP is held by another owner
	CodeExhausted  = "exhausted"   // 409: no free IP in the pool, the message says why
	CodeDisabled   = "disabled"    // 409: the pool is disabled and hands out nothing new
	CodeTooLarge   = "too_large"   // 413
	CodeTryAgain   = "try_again"   // 503: etcd or the lease is unavailable; retry later
	CodeInternal   = "internal"    // 500
	// CodeNameTaken (409): another agent (another boot ID or node
	// addresses) holds this node's name; this one serves no new ADDs
	// until it is restarted. The message names both agents.
	CodeNameTaken = "node_name_taken"
	// CodePortInUse (409): a port mapping overlaps another pod's on the
	// node; the message names that pod.
	CodePortInUse = "port_in_use"
)

// Error is the body of every non-2xx answer.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"error"`
	// Field is the JSON path of the offending request field, if any.
	Field string `json:"field,omitempty"`
	// Status is the HTTP status; filled in by the client, not sent.
	Status int `json:"-"`
}

func (e *Error) Error() string {
	if e.Field != "" {
		return e.Message + " (field " + e.Field + ")"
	}
	return e.Message
}

// Owner identifies an attachment: ContainerID and IfName are the key. It
// is the stored record's owner (records.Owner), one definition for the
// wire and for etcd, so the two cannot drift apart.
type Owner = records.Owner

// AllocateRequest asks for one IP per family for an owner.
type AllocateRequest struct {
	Owner Owner `json:"owner"`
	// PodPool is the pool the pod asks for (its kvipam.io/pool
	// annotation); it comes first.
	PodPool string `json:"podPool,omitempty"`
	// Pool is the network configuration's pool. The agent uses, in this
	// order: PodPool, the pool bound to the pod's namespace (kvipamctl
	// pool bind-namespace), Pool, its own default pool.
	Pool string `json:"pool,omitempty"`
	// Families: "ipv4", "ipv6"; default every family of the pool.
	Families []string `json:"families,omitempty"`
	// IPs are requested static addresses. The CNI "ips" capability's
	// CIDR form ("10.1.0.5/24") is the plugin's to convert: only the
	// address is sent.
	IPs Addrs `json:"ips,omitempty"`
	// Permanent skips the reservation step (IPAM-only plugins, whose
	// endpoint the agent does not create). Default: a reservation that
	// the endpoint create confirms.
	Permanent bool `json:"permanent,omitempty"`
	// Sticky (a duration, "10m": the pod's kvipam.io/sticky annotation)
	// makes the addresses follow the pod's identity, namespace/pod or
	// namespace/IPClaim (its kvipam.io/ip-claim), kept that long after
	// its DEL for the identity's next pod on any node.
	Sticky  string `json:"sticky,omitempty"`
	IPClaim string `json:"ipClaim,omitempty"`
	// Migration, with Sticky, marks the pod as the target of a live
	// migration of its sticky identity (KubeVirt's
	// kubevirt.io/migrationJobName, or kvipam.io/migration-target): while
	// another pod holds the identity, it is admitted as the identity's
	// second, non-forwarding owner (AllocateResponse.Alternate).
	Migration string `json:"migration,omitempty"`
}

// IPConfig is one allocated address and how to reach the node from it.
type IPConfig struct {
	// Address is the pod address with its host prefix: 10.0.0.5/32.
	Address netip.Prefix `json:"address"`
	Family  string       `json:"family"`
	// Gateway is the link-local next hop the pod routes through
	// (GatewayV4 or GatewayV6).
	Gateway netip.Addr `json:"gateway"`
	// Block is the node block the address came from: 10.0.0.0/26.
	Block netip.Prefix `json:"block"`
}

// AllocateResponse is what an owner holds after an allocate, and all a
// plugin needs to set the pod up: each address with its gateway, and the
// pod MTU.
type AllocateResponse struct {
	Pool  string     `json:"pool"`
	IPs   []IPConfig `json:"ips"`
	State string     `json:"state"` // reserved or allocated
	// Expires is when a reservation lapses unless an endpoint is created.
	Expires *time.Time `json:"expires,omitempty"`
	MTU     int        `json:"mtu"`
	// Alternate says the pod was admitted as a live migration's second,
	// non-forwarding owner of IPs: the plugin routes nothing to it on the
	// host; the agent does at the cut-over (the guest's announcement).
	Alternate bool `json:"alternate,omitempty"`
}

// ReleaseRequest frees an owner's IPs and removes its endpoint.
type ReleaseRequest struct {
	Owner Owner `json:"owner"`
	// HostIfName, when set, is the attachment's host veth, which must be a
	// veth named with HostVethPrefix. The agent retires it before it
	// releases: its routes are deleted, the datapath drops its traffic,
	// and it is marked for deletion, which the agent does in the
	// background (many veths in one netlink operation).
	HostIfName string `json:"hostIfName,omitempty"`
	// Sticky and IPClaim are what the pod's ADD sent (its kvipam.io/sticky
	// and kvipam.io/ip-claim annotations), with Owner's namespace and pod:
	// the sticky identity its addresses follow. The agent names it to the
	// allocator even when it has no endpoint of the owner (kvipam-ipam's
	// attachments, an ADD that failed before its endpoint was created), so
	// that a binding naming the container goes with its DEL, and keeps it
	// until the release has landed.
	Sticky  string `json:"sticky,omitempty"`
	IPClaim string `json:"ipClaim,omitempty"`
}

// ReleaseResponse lists the addresses released, as text ("10.0.0.5");
// empty if none were held.
type ReleaseResponse struct {
	Released []string `json:"released"`
	// HostIf says what became of the request's HostIfName: HostIfRetired
	// or HostIfAbsent. An agent that does not know the field leaves it
	// empty, and the caller deletes the veth itself.
	HostIf string `json:"hostIf,omitempty"`
}

// What became of a release's host veth (ReleaseResponse.HostIf).
const (
	HostIfRetired = "retired" // retired now or earlier; deleted in the background
	HostIfAbsent  = "absent"  // no such interface
)

// HostVethPrefix starts the name of every host-side veth kvipam creates.
const HostVethPrefix = "kv"

// ReapLinkGroup is the link group of host veths a DEL retired, which the
// agent deletes in the background ("kvip"). Until then the pod end of
// such a veth may still hold the pod's interface name, and an ADD that
// needs the name deletes the retired pair itself.
const ReapLinkGroup = 0x6b766970

// EndpointRequest asks the agent to finish an ADD: make the reservation
// permanent and program the datapath for the pod, before it answers.
type EndpointRequest struct {
	Owner           Owner  `json:"owner"`
	HostIfName      string `json:"hostIfName"`
	ContainerIfName string `json:"containerIfName,omitempty"`
	ContainerMAC    string `json:"containerMAC,omitempty"`
	Netns           string `json:"netns,omitempty"`
	// IPs are the pod's addresses with their host prefix (10.0.0.5/32),
	// as the allocate answer gave them; each must be held by Owner.
	IPs Prefixes `json:"ips"`
	// EgressLimited: the pod's egress is limited (the runtime's bandwidth
	// capability), so a chained bandwidth plugin will add an ingress qdisc
	// on the host veth; the bpf datapath then attaches with TCX.
	EgressLimited bool `json:"egressLimited,omitempty"`
	// PortMappings are the pod's host ports (the runtime's portMappings
	// capability), served by the bpf datapath.
	PortMappings []PortMapping `json:"portMappings,omitempty"`
}

// PortMapping is one host port of a pod, as CNI's portMappings capability
// gives it: hostPort on hostIP (empty: every address of the node, of each
// family the pod has) reaches the pod's containerPort.
type PortMapping struct {
	HostPort      int    `json:"hostPort"`
	ContainerPort int    `json:"containerPort"`
	Protocol      string `json:"protocol,omitempty"` // tcp (default) or udp
	HostIP        string `json:"hostIP,omitempty"`
}

// Endpoint is a pod attachment the agent has programmed.
type Endpoint struct {
	ID              uint32 `json:"id"`
	Owner           Owner  `json:"owner"`
	HostIfName      string `json:"hostIfName"`
	HostIfIndex     int    `json:"hostIfIndex,omitempty"`
	ContainerIfName string `json:"containerIfName,omitempty"`
	ContainerMAC    string `json:"containerMAC,omitempty"`
	Netns           string `json:"netns,omitempty"`
	// IPs are the endpoint's addresses, without prefix: 10.0.0.5. The
	// agent's endpoint records on disk hold the same text.
	IPs           []netip.Addr `json:"ips"`
	EgressLimited bool         `json:"egressLimited,omitempty"`
	// PortMappings are the host ports the datapath serves for the pod;
	// kept on disk, so that a restarted agent programs them again.
	PortMappings []PortMapping `json:"portMappings,omitempty"`
	// StickyIdentity and StickyWindowSeconds are the sticky identity the
	// endpoint's addresses follow, if any: kept on disk so that an agent
	// restarted after etcd lost the records writes them back with it.
	StickyIdentity      string `json:"stickyIdentity,omitempty"`
	StickyWindowSeconds int64  `json:"stickyWindowSeconds,omitempty"`
	// Pool is the pool of the endpoint's addresses.
	Pool string `json:"pool,omitempty"`
	// Alternate marks a live migration's second, non-forwarding owner:
	// the node routes its addresses to the pod that forwards, and this
	// endpoint's guest announcement cuts over to it.
	Alternate bool      `json:"alternate,omitempty"`
	Datapath  string    `json:"datapath"`
	Created   time.Time `json:"created"`
	// Counters are the datapath's per-endpoint counters (bpf mode only),
	// filled when the list is asked for with ?stats=1.
	Counters *Counters `json:"counters,omitempty"`
}

// Counters are packets and bytes the endpoint's program passed and dropped
// (dropped: a source address that is not the endpoint's).
type Counters struct {
	PassedPackets  uint64 `json:"passedPackets"`
	PassedBytes    uint64 `json:"passedBytes"`
	DroppedPackets uint64 `json:"droppedPackets"`
	DroppedBytes   uint64 `json:"droppedBytes"`
}

// EndpointList is the answer of GET /v1/endpoints.
type EndpointList struct {
	Endpoints []Endpoint `json:"endpoints"`
}

// Attachment is one entry of CNI's cni.dev/valid-attachments.
type Attachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// GCRequest releases this node's allocations (in Pool, or every pool;
// of Network, or every network) whose owner is not among
// ValidAttachments.
type GCRequest struct {
	ValidAttachments []Attachment `json:"validAttachments"`
	Pool             string       `json:"pool,omitempty"`
	Network          string       `json:"network,omitempty"`
}

// GCResponse says what a GC released and what it left for a later pass
// (allocations younger than the grace period). Released is as in
// ReleaseResponse.
type GCResponse struct {
	Released []string `json:"released"`
	Deferred int      `json:"deferred"`
}

// Config is the agent's settings that clients may need: the default pool
// (STATUS and GC of a configuration that names none), the MTU and the
// gateways. ADD does not ask for it: the allocate answer carries what
// the pod needs.
type Config struct {
	Node        string     `json:"node"`
	MTU         int        `json:"mtu"`
	DefaultPool string     `json:"defaultPool"`
	Pools       []string   `json:"pools"`
	Datapath    string     `json:"datapath"` // "routes" or "bpf"
	GatewayV4   netip.Addr `json:"gatewayV4"`
	GatewayV6   netip.Addr `json:"gatewayV6"`
	// ReservationTTL is how long a reservation waits for its endpoint.
	ReservationTTL string `json:"reservationTTL"`
}

// Status is the agent's health: it is Ready when it can allocate.
type Status struct {
	Node     string       `json:"node"`
	Version  string       `json:"version"`
	Ready    bool         `json:"ready"`
	Restored bool         `json:"restored"`
	Etcd     EtcdStatus   `json:"etcd"`
	Lease    LeaseStatus  `json:"lease"`
	Datapath string       `json:"datapath"`
	Pools    []PoolStatus `json:"pools"`
	Message  string       `json:"message,omitempty"`
	// BGP is the speaker's state with routing bgp.
	BGP *BGPStatus `json:"bgp,omitempty"`
	// NameTaken is set once another agent (another boot ID or node
	// addresses) was found holding this node's name: this agent then
	// serves no new ADDs and claims nothing until it is restarted.
	NameTaken *NameTaken `json:"nameTaken,omitempty"`
	// NameContested is set while another incarnation's node record
	// (another boot ID or node addresses) is on a lease this agent has
	// not yet seen renewed: it serves no new ADDs (try again) until the
	// lease is renewed (the name is taken: NameTaken) or ends unrenewed
	// (the agent takes its name back), at most the lease TTL and a
	// second.
	NameContested *NameContested `json:"nameContested,omitempty"`
}

// NameContested says whose node record this agent waits on, and since
// when.
type NameContested struct {
	Since  time.Time   `json:"since"`
	Holder Incarnation `json:"holder"`
}

// NameTaken says who holds this node's name instead of this agent, and
// since when this agent knows it.
type NameTaken struct {
	Since  time.Time   `json:"since"`
	Holder Incarnation `json:"holder"`
	Self   Incarnation `json:"self"`
}

// Incarnation is one agent under a node name: its machine's boot ID and
// its node addresses, which tell two agents apart, with its version, when
// it started and the etcd lease its node record is on.
type Incarnation struct {
	BootID    string    `json:"bootID"`
	Addresses []string  `json:"addresses"`
	Version   string    `json:"version,omitempty"`
	StartedAt time.Time `json:"startedAt"`
	Lease     int64     `json:"lease,omitempty"`
}

// BGPStatus is the node's BGP speaker: its AS, the prefixes it announces
// per family (ipv4, ipv6), and each peer's session.
type BGPStatus struct {
	ASN       uint32          `json:"asn"`
	Announced map[string]int  `json:"announced"`
	Peers     []BGPPeerStatus `json:"peers"`
	Error     string          `json:"error,omitempty"`
}

// BGPPeerStatus is one router's session: its state (idle, connect,
// active, opensent, openconfirm, established), the prefixes sent to
// (none on a session that is not established) and received from it per
// family, and, while it is not established, why: Reason for a person
// (the connect error, or the NOTIFICATION sent or received with its code
// and subcode), ReasonClass as the metric's label has it, and since when.
type BGPPeerStatus struct {
	Address     string            `json:"address"`
	ASN         uint32            `json:"asn"`
	State       string            `json:"state"`
	Advertised  map[string]uint64 `json:"advertised"`
	Received    map[string]uint64 `json:"received"`
	Uptime      time.Duration     `json:"uptime"`
	Reason      string            `json:"reason,omitempty"`
	ReasonClass string            `json:"reasonClass,omitempty"`
	ReasonSince time.Time         `json:"reasonSince,omitzero"`
}

// EtcdStatus says whether etcd answered the agent's last probe.
type EtcdStatus struct {
	Reachable bool     `json:"reachable"`
	Embedded  bool     `json:"embedded"`
	Endpoints []string `json:"endpoints"`
	Error     string   `json:"error,omitempty"`
}

// LeaseStatus is the node lease: "held" or "lost".
type LeaseStatus struct {
	ID    int64  `json:"id"`
	TTL   int64  `json:"ttl"`
	State string `json:"state"`
}

// PoolStatus is this node's share of one pool family.
type PoolStatus struct {
	Pool   string         `json:"pool"`
	Family string         `json:"family"`
	Blocks []netip.Prefix `json:"blocks"`
	// Capacity and Free are what this node's blocks can hand out, ever
	// and now. Used counts the addresses the node holds, Reserved those
	// that are reservations of unfinished ADDs, Borrowed those in other
	// nodes' blocks; Lent counts addresses of its blocks other nodes hold.
	Capacity int `json:"capacity"`
	Used     int `json:"used"`
	Reserved int `json:"reserved"`
	Free     int `json:"free"`
	Borrowed int `json:"borrowed"`
	Lent     int `json:"lent"`
	// Size is the pool's number of addresses of the family, ReservedRanges
	// those in ranges an operator reserved.
	Size           uint64 `json:"size"`
	ReservedRanges uint64 `json:"reservedRanges"`
	Disabled       bool   `json:"disabled,omitempty"`
	// Refused says why the agent refuses the pool's spec from etcd (it
	// overlaps a special range, or is otherwise invalid): it hands out
	// nothing new from it; pods keep what they hold, releases go on.
	Refused string `json:"refused,omitempty"`
	// Exhausted: the last ADD found no free address in the whole pool;
	// ExhaustedReason is that error, which says why and whether it is
	// temporary. A later success or a release clears both.
	Exhausted       bool   `json:"exhausted"`
	ExhaustedReason string `json:"exhaustedReason,omitempty"`
}

// Allocation is one address an owner holds.
type Allocation struct {
	Pool    string       `json:"pool"`
	Address netip.Prefix `json:"address"` // 10.0.0.5/32
	Block   netip.Prefix `json:"block"`
	State   string       `json:"state"` // reserved or allocated
}

// AllocationList is the answer of GET /v1/allocations.
type AllocationList struct {
	Allocations []Allocation `json:"allocations"`
}
