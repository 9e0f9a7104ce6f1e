package main

import (
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strings"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/foundation/configfile"
)

// loadConfig builds a Config from args (without the program name) and an
// environment lookup. The YAML file named by --config is read first,
// KVIPAM_<FLAG> variables override it, and flags override both.
func loadConfig(args []string, getenv func(string) string) (agent.Config, error) {
	c := agent.DefaultConfig()
	fs := flag.NewFlagSet("kvipam-agent", flag.ContinueOnError)
	fs.SetOutput(new(strings.Builder))
	var (
		configFile     string
		pools          poolFlags
		block4, block6 int
		showVersion    bool
		endpoints      string
	)
	fs.StringVar(&configFile, "config", "", "YAML configuration file")
	fs.BoolVar(&showVersion, "version", false, "print the version and exit")
	fs.StringVar(&c.Node, "node", c.Node, "node name (default: hostname)")
	fs.StringVar(&endpoints, "etcd-endpoints", "", "the cluster's etcd endpoints, comma-separated (this or --etcd-embedded)")
	fs.BoolVar(&c.Etcd.Embedded, "etcd-embedded", c.Etcd.Embedded, "run an embedded single-member etcd of this node's own in <state-dir>/etcd instead of the cluster's (this or --etcd-endpoints)")
	fs.StringVar(&c.Etcd.CAFile, "etcd-cacert", "", "etcd CA file")
	fs.StringVar(&c.Etcd.CertFile, "etcd-cert", "", "etcd client certificate")
	fs.StringVar(&c.Etcd.KeyFile, "etcd-key", "", "etcd client key")
	fs.StringVar(&c.Etcd.Username, "etcd-user", "", "etcd user")
	fs.StringVar(&c.Etcd.Password, "etcd-password", "", "etcd password")
	fs.DurationVar(&c.Etcd.DialTimeout.Duration, "etcd-dial-timeout", c.Etcd.DialTimeout.Duration, "etcd dial timeout")
	fs.DurationVar(&c.Etcd.CallTimeout.Duration, "etcd-call-timeout", c.Etcd.CallTimeout.Duration, "abandon one etcd request not answered in this time and retry it (a leader lost, a member gone); the outcome of an abandoned write is read back")
	fs.StringVar(&c.StateDir, "state-dir", c.StateDir, "node-local state: endpoint records, embedded etcd data")
	fs.StringVar(&c.Socket, "socket", c.Socket, "unix socket of the API")
	fs.Var(&pools, "pool", "pool NAME=CIDR[,CIDR...] to create in etcd if etcd has no pool of that name (repeatable); etcd's spec always wins")
	fs.IntVar(&block4, "block-size-v4", 26, "IPv4 block prefix length for --pool")
	fs.IntVar(&block6, "block-size-v6", 120, "IPv6 block prefix length for --pool")
	fs.StringVar(&c.DefaultPool, "default-pool", c.DefaultPool, "pool for requests that name none (default: the first --pool, else the one pool that serves this node)")
	var nodeLabels string
	fs.StringVar(&nodeLabels, "node-labels", "", "this node's labels, k=v comma-separated (rack=r1,zone=a), which pools' node selectors choose by")
	fs.DurationVar(&c.LeaseTTL.Duration, "lease-ttl", c.LeaseTTL.Duration, "node lease TTL")
	fs.DurationVar(&c.ReservationTTL.Duration, "reservation-ttl", c.ReservationTTL.Duration, "how long a reservation waits for its endpoint")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "Prometheus listen address; empty disables")
	fs.StringVar(&c.Datapath, "datapath", c.Datapath, "routes, bpf or auto")
	fs.IntVar(&c.MTU, "mtu", c.MTU, "pod MTU; 0 detects from the default route")
	fs.DurationVar(&c.GCGrace.Duration, "gc-grace", c.GCGrace.Duration, "age before a gone owner's IP is released")
	fs.Func("reuse-cooldown", "removed: the reuse cooldown is each pool's setting in etcd (kvipamctl pool set-cooldown)", func(string) error { return agent.ErrReuseCooldownMoved })
	fs.DurationVar(&c.GCInterval.Duration, "gc-interval", c.GCInterval.Duration, "how often the reconciler looks for gone endpoints")
	fs.StringVar(&c.DelQueueDir, "del-queue-dir", c.DelQueueDir, "where plugins queue DELs while the agent is down (default <state-dir>/del-queue)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "trace, debug, info, warn or error")
	fs.DurationVar(&c.RequestTimeout.Duration, "request-timeout", c.RequestTimeout.Duration, "etcd time budget of one request")
	fs.IntVar(&c.MaxBatch, "max-batch", c.MaxBatch, "most allocations in one etcd transaction")
	fs.DurationVar(&c.BatchWait.Duration, "batch-wait", c.BatchWait.Duration, "longest a batch stays open for more requests under load")
	fs.StringVar(&c.BPFPinDir, "bpf-pin-dir", c.BPFPinDir, "bpffs directory for pinned maps and links")
	fs.StringVar(&c.BPFAttach, "bpf-attach", c.BPFAttach, "how the bpf datapath attaches to a host veth: tcx (a TCX link; composes with other tc users; an RCU grace period per attach and detach), tc (a clsact filter: cheap, but excludes the ingress qdisc of the bandwidth plugin's egress shaping) or auto (tc, and tcx for pods whose egress is limited)")
	fs.StringVar(&c.NetNS, "netns", c.NetNS, "network namespace path of the pod interfaces (default: the agent's own)")
	var nodeAddrs, hostPortDevs string
	fs.StringVar(&hostPortDevs, "hostport-devices", "", "interfaces other hosts reach pods' host ports through, comma-separated (bpf datapath; default: those of the default routes and of the node addresses)")
	fs.StringVar(&nodeAddrs, "node-address", "", "addresses other nodes route this node's blocks to, comma-separated (default: the global unicast addresses)")
	fs.StringVar(&c.EmbeddedListen, "embedded-etcd-listen", c.EmbeddedListen, "client URL of the embedded etcd (--etcd-embedded), e.g. http://10.0.0.1:2379 (default: a loopback port)")
	fs.DurationVar(&c.HistoryRetention.Duration, "history-retention", c.HistoryRetention.Duration, "how long etcd keeps a record of each ended address ownership (kvipamctl ip history); 0 turns it off")
	fs.StringVar(&c.Routing, "routing", c.Routing, "how pods reach other nodes' pods: host-gw (nodes on one L2 segment), vxlan (an overlay), bgp (blocks announced to the routers of the config file's bgp section) or none (the network routes pod blocks)")
	fs.IntVar(&c.VXLAN.VNI, "vxlan-vni", c.VXLAN.VNI, "VXLAN network identifier of routing vxlan (the same on every node)")
	fs.IntVar(&c.VXLAN.Port, "vxlan-port", c.VXLAN.Port, "UDP port of routing vxlan (the same on every node)")
	fs.StringVar(&c.VXLAN.Underlay, "vxlan-underlay", c.VXLAN.Underlay, "family of routing vxlan's tunnel endpoints, ipv4 or ipv6 (the same on every node); either carries IPv4 and IPv6 pods")
	var nonMasq string
	fs.StringVar(&nonMasq, "non-masquerade-cidrs", "", "destinations pods reach with their own addresses even from a masquerading pool, comma-separated CIDRs (every pool's CIDRs are never masqueraded anyway)")

	// The config file comes first, so find it before parsing for real.
	pre := flag.NewFlagSet("", flag.ContinueOnError)
	pre.SetOutput(new(strings.Builder))
	pre.StringVar(&configFile, "config", getenv("KVIPAM_CONFIG"), "")
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name != "config" {
			bf, ok := f.Value.(interface{ IsBoolFlag() bool })
			pre.Var(noopValue{isBool: ok && bf.IsBoolFlag()}, f.Name, "")
		}
	})
	if err := pre.Parse(args); err != nil {
		return c, usageError(fs, err)
	}
	if configFile != "" {
		data, err := os.ReadFile(configFile)
		if err != nil {
			return c, fmt.Errorf("read config: %w", err)
		}
		if err := configfile.Unmarshal(data, &c); err != nil {
			return c, fmt.Errorf("config %s: %w", configFile, err)
		}
		if len(c.Etcd.Endpoints) > 0 {
			endpoints = strings.Join(c.Etcd.Endpoints, ",")
		}
	}
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		name := "KVIPAM_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(name); v != "" && f.Name != "config" {
			if err := fs.Set(f.Name, v); err != nil {
				envErr = errors.Join(envErr, fmt.Errorf("%s=%q: %w", name, v, err))
			}
		}
	})
	if envErr != nil {
		return c, envErr
	}
	if err := fs.Parse(args); err != nil {
		return c, usageError(fs, err)
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if showVersion {
		return c, errShowVersion
	}
	if endpoints != "" {
		c.Etcd.Endpoints = strings.Split(endpoints, ",")
	}
	if nodeAddrs != "" {
		c.NodeAddresses = strings.Split(nodeAddrs, ",")
	}
	if hostPortDevs != "" {
		c.HostPortDevices = strings.Split(hostPortDevs, ",")
	}
	if nonMasq != "" {
		c.Egress.NonMasqueradeCIDRs = nil
		for _, s := range strings.Split(nonMasq, ",") {
			p, err := netip.ParsePrefix(strings.TrimSpace(s))
			if err != nil {
				return c, fmt.Errorf("non-masquerade-cidrs: %w", err)
			}
			c.Egress.NonMasqueradeCIDRs = append(c.Egress.NonMasqueradeCIDRs, p)
		}
	}
	if nodeLabels != "" {
		l, err := allocator.ParseLabels(nodeLabels)
		if err != nil {
			return c, fmt.Errorf("node-labels: %w", err)
		}
		c.NodeLabels = l
	}
	for _, p := range pools {
		p.BlockSizeV4, p.BlockSizeV6 = 0, 0
		for _, cidr := range p.CIDRs {
			if cidr.Addr().Is4() {
				p.BlockSizeV4 = block4
			} else {
				p.BlockSizeV6 = block6
			}
		}
		c.Pools = append(c.Pools, p)
	}
	return c, c.Validate()
}

// errShowVersion is returned by loadConfig for --version.
var errShowVersion = errors.New("show version")

func usageError(fs *flag.FlagSet, err error) error {
	if errors.Is(err, flag.ErrHelp) {
		var b strings.Builder
		fs.SetOutput(&b)
		fs.PrintDefaults()
		return fmt.Errorf("%w\n%s", flag.ErrHelp, b.String())
	}
	return err
}

// noopValue stands in for every flag but --config in the first pass.
type noopValue struct{ isBool bool }

func (noopValue) String() string     { return "" }
func (noopValue) Set(string) error   { return nil }
func (v noopValue) IsBoolFlag() bool { return v.isBool }

// poolFlags parses repeated --pool NAME=CIDR[,CIDR...].
type poolFlags []allocator.Pool

func (p *poolFlags) String() string { return fmt.Sprint(*p) }

func (p *poolFlags) Set(v string) error {
	name, cidrs, ok := strings.Cut(v, "=")
	if !ok || name == "" || cidrs == "" {
		return fmt.Errorf("want NAME=CIDR[,CIDR...], got %q", v)
	}
	pool := allocator.Pool{Name: name}
	for _, s := range strings.Split(cidrs, ",") {
		pfx, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("pool %s: %w", name, err)
		}
		pool.CIDRs = append(pool.CIDRs, pfx)
	}
	*p = append(*p, pool)
	return nil
}
