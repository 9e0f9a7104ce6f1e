package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/foundation/duration"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/routing/bgp"
)

// Datapath modes.
const (
	DatapathRoutes = "routes"
	DatapathBPF    = "bpf"
	// BPFAttachAuto attaches the bpf datapath with a clsact filter, and
	// with TCX for pods whose egress is limited (--bpf-attach).
	BPFAttachAuto = "auto"
	DatapathAuto  = "auto"
)

// Config is everything the agent is told at start: a plain struct that
// Validate checks. The kvipam-agent command fills it from defaults, a YAML
// file, KVIPAM_* environment variables and flags, and passes it down;
// nothing reads globals.
type Config struct {
	Node string `json:"node"`
	// Etcd says which etcd the agent uses: the cluster's (endpoints), or
	// an embedded one asked for by name (embedded); never neither.
	Etcd     EtcdConfig `json:"etcd"`
	StateDir string     `json:"stateDir"`
	Socket   string     `json:"socket"`
	// Pools seed etcd: each is created there if etcd has no pool of its
	// name, and otherwise changes nothing (invariant 8: pools live in
	// etcd). The node serves every pool etcd holds whose node selector
	// chooses NodeLabels; none need be given here.
	Pools []allocator.Pool `json:"pools"`
	// DefaultPool is the pool of a request that names none; empty: the
	// first of Pools, else the one pool that serves this node.
	DefaultPool string `json:"defaultPool"`
	// NodeLabels are this node's labels (rack=r1, zone=a), which pools'
	// node selectors choose by; they are written in the node record.
	NodeLabels     map[string]string `json:"nodeLabels"`
	LeaseTTL       Duration          `json:"leaseTTL"`
	ReservationTTL Duration          `json:"reservationTTL"`
	MetricsAddr    string            `json:"metricsAddr"`
	Datapath       string            `json:"datapath"`
	MTU            int               `json:"mtu"`
	GCGrace        Duration          `json:"gcGrace"`
	// ReuseCooldown is refused (ErrReuseCooldownMoved): the reuse
	// cooldown is a pool's setting in etcd (invariant 8).
	ReuseCooldown movedToPool `json:"reuseCooldown,omitzero"`
	GCInterval    Duration    `json:"gcInterval"`
	DelQueueDir   string      `json:"delQueueDir"`
	LogLevel      string      `json:"logLevel"`
	// RequestTimeout bounds the etcd work of one API request.
	RequestTimeout Duration `json:"requestTimeout"`
	// MaxBatch bounds how many allocations share one etcd transaction.
	MaxBatch int `json:"maxBatch"`
	// BatchWait bounds how long a batch stays open under load.
	BatchWait Duration `json:"batchWait"`
	// BPFPinDir is where the bpf datapath pins its maps and links.
	BPFPinDir string `json:"bpfPinDir"`
	// BPFAttach is how the bpf datapath attaches its program to a host
	// veth: tcx (a TCX link: it composes with every other tc user, but
	// each attach and detach waits for an RCU grace period, about 25 ms),
	// tc (a clsact filter, about 1 ms, but a clsact qdisc excludes the
	// ingress qdisc that the bandwidth plugin's egress shaping adds), or
	// auto (the default): tc, and tcx for pods whose egress is limited.
	BPFAttach string `json:"bpfAttach"`
	// HostPortDevices are the interfaces other hosts reach pods' host
	// ports through (the bpf datapath); default: those of the default
	// routes and of the node addresses.
	HostPortDevices []string `json:"hostPortDevices"`
	// NetNS is the network namespace (a path such as /proc/1/ns/net) whose
	// pod interfaces the datapath programs; empty is the agent's own. It
	// lets an agent that is not in the host namespace manage the host's.
	NetNS string `json:"netns"`
	// NodeAddresses are where other nodes route this node's blocks;
	// default: the global unicast addresses of the netns.
	NodeAddresses []string `json:"nodeAddresses"`
	// EmbeddedListen is the client URL of the embedded etcd (default a
	// loopback port), only with Etcd.Embedded. Giving it a node address
	// lets a small lab cluster's other agents use this node's embedded
	// etcd.
	EmbeddedListen string `json:"embeddedListen"`
	// HistoryRetention is how long a record of an ended ownership interval
	// (IP history) lives in etcd; 0 turns history off.
	HistoryRetention Duration `json:"historyRetention"`
	// Routing is how pods reach pods on other nodes: host-gw (other
	// nodes' blocks routed to their addresses, nodes on one L2 segment),
	// vxlan (an overlay for nodes on different networks) or none (the
	// network routes pod blocks).
	Routing string `json:"routing"`
	// VXLAN tunes the overlay of routing vxlan.
	VXLAN VXLANConfig `json:"vxlan"`
	// BGP is the speaker of routing bgp: the node's AS, the routers it
	// peers with, what it adds to its announcements (docs/routing.md).
	BGP bgp.Config `json:"bgp,omitzero"`
	// Egress tunes the node's egress masquerade, which each pool turns
	// on or off in etcd (docs/routing.md, "Egress").
	Egress EgressConfig `json:"egress"`
}

// EgressConfig is what this node's egress masquerade never translates.
type EgressConfig struct {
	// NonMasqueradeCIDRs are destinations that pods reach with their own
	// addresses even from a masquerading pool: networks that route the
	// pools back to the nodes (a peered VPC, the nodes' own subnet for
	// services that must see pod addresses). Every pool's CIDRs are never
	// masqueraded anyway. It is a node's setting, not a pool's: which
	// networks route pod addresses back may differ by node (a rack's).
	NonMasqueradeCIDRs []netip.Prefix `json:"nonMasqueradeCIDRs"`
}

// Routing modes.
const (
	RoutingHostGW = "host-gw"
	RoutingVXLAN  = "vxlan"
	RoutingNone   = "none"
	// RoutingBGP announces the node's blocks and borrowed addresses to
	// the routers configured in BGP; the network routes pod traffic.
	RoutingBGP = "bgp"
)

// VXLANConfig is the overlay's device: every node must use the same.
type VXLANConfig struct {
	VNI  int `json:"vni"`
	Port int `json:"port"`
	// Underlay is the family of the tunnel endpoints: ipv4 (default) or
	// ipv6. Either carries IPv4 and IPv6 pods.
	Underlay string `json:"underlay"`
}

// Underlay families of the overlay (VXLANConfig.Underlay).
const (
	UnderlayIPv4 = "ipv4"
	UnderlayIPv6 = "ipv6"
)

// Duration is a time.Duration that the configuration file writes as the
// flags do ("15s"); a bare number other than 0 is refused.
type Duration struct{ time.Duration }

// UnmarshalJSON reads a Go duration string (duration.Decode).
func (d *Duration) UnmarshalJSON(b []byte) (err error) {
	d.Duration, err = duration.Decode(b)
	return err
}

// MarshalJSON writes a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// ErrReuseCooldownMoved refuses an agent given a reuse cooldown (the
// reuseCooldown key, --reuse-cooldown, KVIPAM_REUSE_COOLDOWN): every node
// must use the same one, so it is the pool's setting in etcd.
var ErrReuseCooldownMoved = errors.New("reuse-cooldown is no longer an agent setting: every node must use the same, so it is each pool's, in etcd (kvipamctl pool set-cooldown POOL DURATION; kvipamctl pool show POOL shows it; a pool this agent seeds may carry reuseCooldown)")

// movedToPool is an agent key that became a pool's setting: giving it is
// an error that says so.
type movedToPool struct{}

// UnmarshalJSON refuses the key.
func (movedToPool) UnmarshalJSON([]byte) error { return ErrReuseCooldownMoved }

// DefaultConfig is the configuration with nothing set.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		Node:           host,
		Etcd:           EtcdConfig{DialTimeout: Duration{kvstore.DefaultDialTimeout}, CallTimeout: Duration{kvstore.DefaultCallTimeout}},
		StateDir:       "/var/lib/kvipam",
		Socket:         "/run/kvipam/agent.sock",
		LeaseTTL:       Duration{15 * time.Second},
		ReservationTTL: Duration{2 * time.Minute},
		MetricsAddr:    "127.0.0.1:9464",
		Datapath:       DatapathAuto,
		GCGrace:        Duration{5 * time.Minute},
		GCInterval:     Duration{30 * time.Second},
		LogLevel:       "info",
		RequestTimeout: Duration{5 * time.Second},
		MaxBatch:       nodealloc.MaxBatch,
		BatchWait:      Duration{2 * time.Millisecond},
		BPFPinDir:      "/sys/fs/bpf/kvipam",
		BPFAttach:      BPFAttachAuto,
		Routing:        RoutingHostGW,
		VXLAN:          VXLANConfig{VNI: 1, Port: 4789, Underlay: UnderlayIPv4},
		// A week: kvipamctl ip history answers for it, and etcd holds about
		// 0.5 KB per release for that long (docs/operations.md).
		HistoryRetention: Duration{7 * 24 * time.Hour},
	}
}

// Validate reports every configuration mistake at once, naming the field.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Node == "" {
		bad("node: empty (set --node or KVIPAM_NODE)")
	} else if strings.ContainsAny(c.Node, "/ \t\n") {
		bad("node: %q must not contain '/' or spaces", c.Node)
	}
	if c.StateDir == "" {
		bad("state-dir: empty")
	}
	if c.Socket == "" {
		bad("socket: empty")
	}
	names := map[string]bool{}
	for _, p := range c.Pools {
		if err := p.Validate(); err != nil {
			bad("pool %s: %w", p.Name, err)
		}
		if names[p.Name] {
			bad("pool %s: given twice", p.Name)
		}
		if p.MaxBlocksPerNode != 0 {
			// A schema feature (allocator/schema): written only once every
			// live node understands it, which a seed at the first agent's
			// start cannot know.
			bad("pool %s: maxBlocksPerNode is not an agent setting: set it with kvipamctl pool set-max-blocks once every agent runs a release that understands it", p.Name)
		}
		names[p.Name] = true
	}
	if c.DefaultPool != "" {
		if err := allocator.ValidatePoolName(c.DefaultPool); err != nil {
			bad("default-pool: %q: %w", c.DefaultPool, err)
		}
	}
	if err := allocator.CheckLabels(c.NodeLabels); err != nil {
		bad("node-labels: %w", err)
	}
	if c.LeaseTTL.Duration < 2*time.Second {
		bad("lease-ttl: %s is below etcd's 2s minimum", c.LeaseTTL)
	}
	if c.ReservationTTL.Duration < time.Second {
		bad("reservation-ttl: %s is below 1s", c.ReservationTTL)
	}
	switch c.Datapath {
	case DatapathRoutes, DatapathBPF, DatapathAuto:
	default:
		bad("datapath: %q is not routes, bpf or auto", c.Datapath)
	}
	switch c.BPFAttach {
	case "tc", "tcx", BPFAttachAuto:
	default:
		bad("bpf-attach: %q is not auto, tc or tcx", c.BPFAttach)
	}
	switch c.Routing {
	case RoutingHostGW, RoutingVXLAN, RoutingNone:
		if len(c.BGP.Peers) > 0 || c.BGP.ASN != 0 {
			bad("bgp: configured, but routing is %q: set routing bgp, or remove the bgp section", c.Routing)
		}
	case RoutingBGP:
		if err := c.BGP.Validate(); err != nil {
			errs = append(errs, err)
		}
		if rt, most := c.BGP.RestartTime.Duration, bgp.MaxRestartTime(c.LeaseTTL.Duration); rt > most {
			bad("bgp.restartTime: %s is more than %s, half the lease TTL (%s): routers would keep a gone node's routes after etcd may have given its blocks to another node", rt, most, c.LeaseTTL)
		}
	default:
		bad("routing: %q is not host-gw, vxlan, bgp or none", c.Routing)
	}
	if c.VXLAN.VNI < 1 || c.VXLAN.VNI > 1<<24-1 {
		bad("vxlan-vni: %d out of range 1-16777215", c.VXLAN.VNI)
	}
	switch c.VXLAN.Underlay {
	case UnderlayIPv4, UnderlayIPv6:
	default:
		bad("vxlan-underlay: %q is not ipv4 or ipv6", c.VXLAN.Underlay)
	}
	if c.VXLAN.Port < 1 || c.VXLAN.Port > 65535 {
		bad("vxlan-port: %d out of range 1-65535", c.VXLAN.Port)
	}
	if c.MTU != 0 && (c.MTU < 576 || c.MTU > 65535) {
		bad("mtu: %d out of range 576-65535 (0 = detect)", c.MTU)
	}
	if c.GCGrace.Duration < 0 || c.GCInterval.Duration <= 0 {
		bad("gc-grace/gc-interval: must be positive")
	}
	if c.RequestTimeout.Duration <= 0 {
		bad("request-timeout: must be positive")
	}
	if c.BatchWait.Duration < 0 || c.BatchWait.Duration > time.Second {
		bad("batch-wait: %s out of range 0-1s", c.BatchWait)
	}
	if c.HistoryRetention.Duration < 0 {
		bad("history-retention: %s must not be negative (0 turns history off)", c.HistoryRetention)
	}
	if c.MaxBatch < 1 {
		bad("max-batch: %d must be at least 1", c.MaxBatch)
	}
	for _, p := range c.Egress.NonMasqueradeCIDRs {
		if !p.IsValid() || p != p.Masked() {
			bad("egress.nonMasqueradeCIDRs: %s has host bits set, did you mean %s", p, p.Masked())
		}
	}
	for _, s := range c.NodeAddresses {
		if _, err := netip.ParseAddr(s); err != nil {
			bad("node-address: %q is not an IP address", s)
		}
	}
	if err := c.Etcd.validate(c.EmbeddedListen); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// PoolForRequest is the pool used when a request names none: DefaultPool,
// else the first pool of the configuration; "" leaves the choice to what
// etcd says (the one pool that serves the node).
func (c *Config) PoolForRequest() string {
	if c.DefaultPool != "" {
		return c.DefaultPool
	}
	if len(c.Pools) > 0 {
		return c.Pools[0].Name
	}
	return ""
}

func (c *Config) delQueueDir() string {
	if c.DelQueueDir != "" {
		return c.DelQueueDir
	}
	return filepath.Join(c.StateDir, "del-queue")
}
