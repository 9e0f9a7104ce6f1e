package cni

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator"
)

// Defaults of the settings a configuration may leave out.
const (
	DefaultAgentSocket  = client.DefaultSocket
	DefaultAgentTimeout = 10 * time.Second
	DefaultDelQueueDir  = "/var/lib/kvipam/del-queue"
)

// maxAgentTimeout bounds agentTimeout: a runtime gives up on a plugin after
// a few minutes, so waiting longer than that only hides the failure.
const maxAgentTimeout = 5 * time.Minute

// Config is a validated kvipam or kvipam-ipam network configuration: the
// fields of the plugin's stdin the plugins use, with defaults filled in.
type Config struct {
	CNIVersion string
	Name       string
	// Socket is the agent's unix socket.
	Socket string
	// Pool is the agent pool to allocate from; empty means the agent's
	// default pool.
	Pool string
	// Families limits the allocation to "ipv4" and/or "ipv6"; empty means
	// every family of the pool.
	Families []string
	// AgentTimeout bounds the wait for the agent's socket on ADD and each
	// call to the agent.
	AgentTimeout time.Duration
	// DelQueueDir is where DEL queues a release while the agent is down.
	DelQueueDir string
	// MTU overrides the agent's pod MTU when not 0 (kvipam only).
	MTU int
	DNS types.DNS
	// IPs are static addresses from the "ips" capability or the pod's
	// kvipam.io/ips annotation.
	IPs []netip.Addr
	// PodPool is the pool of the pod's kvipam.io/pool annotation.
	PodPool string
	// Sticky is the pod's kvipam.io/sticky window (its addresses follow
	// its identity), IPClaim its kvipam.io/ip-claim identity name.
	Sticky  time.Duration
	IPClaim string
	// Migration names the live migration whose target the pod is
	// (annotations.go): its ADD is admitted as the identity's alternate.
	Migration string
	// EgressLimited: the runtime's bandwidth capability limits the pod's
	// egress, so a chained bandwidth plugin adds an ingress qdisc on the
	// host veth (the agent's bpf datapath then attaches with TCX).
	EgressLimited bool
	// PortMappings are the pod's host ports (the portMappings
	// capability), which the agent's bpf datapath serves.
	PortMappings []api.PortMapping
	// PrevResult is the parsed prevResult, nil when none (or DEL).
	PrevResult *current.Result
	// ValidAttachments is the GC list; nil when the configuration has
	// neither cni.dev/valid-attachments nor cni.dev/attachments.
	ValidAttachments []api.Attachment
	LogLevel         string
	LogFile          string
	// UnknownKey is the refusal of a key kvipam does not know, kept
	// instead of returned by ParseDelConfig and ParseIPAMDelConfig.
	UnknownKey error

	// GatewayV4, GatewayV6 and Routes shape kvipam-ipam's result; the
	// zero values mean the agent's link-local gateways and default routes.
	GatewayV4 netip.Addr
	GatewayV6 netip.Addr
	Routes    []*types.Route
	// AddressPrefix is AddressPrefixBlock or AddressPrefixHost.
	AddressPrefix string
	// PrefixLengthV4 and PrefixLengthV6, when not 0, are the prefix
	// lengths of the addresses instead: the subnet of a LAN that macvlan
	// pods share with their router.
	PrefixLengthV4, PrefixLengthV6 int
}

// Values of kvipam-ipam's ipam.addressPrefix.
const (
	// AddressPrefixBlock gives each address its block's prefix length.
	AddressPrefixBlock = "block"
	// AddressPrefixHost gives each address a /32 or /128.
	AddressPrefixHost = "host"
)

// settings are the kvipam keys both plugins read: at the top level of a
// kvipam configuration, under "ipam" for kvipam-ipam.
type settings struct {
	AgentSocket  string   `json:"agentSocket"`
	Pool         string   `json:"pool"`
	Families     []string `json:"families"`
	AgentTimeout string   `json:"agentTimeout"`
	DelQueueDir  string   `json:"delQueueDir"`
	LogLevel     string   `json:"logLevel"`
	LogFile      string   `json:"logFile"`
}

// common are the keys of the CNI spec both plugins read.
type common struct {
	CNIVersion    string         `json:"cniVersion"`
	Name          string         `json:"name"`
	Type          string         `json:"type"`
	DNS           types.DNS      `json:"dns"`
	RawPrevResult map[string]any `json:"prevResult"`
	RuntimeConfig struct {
		IPs []string `json:"ips"`
		// PodAnnotations are the pod's annotations, which containerd and
		// CRI-O pass when the conflist declares this capability.
		PodAnnotations map[string]string `json:"io.kubernetes.cri.pod-annotations"`
		// Bandwidth is the pod's traffic shaping, passed when the
		// conflist declares the bandwidth capability for kvipam too.
		Bandwidth *struct {
			EgressRate  uint64 `json:"egressRate"`
			EgressBurst uint64 `json:"egressBurst"`
		} `json:"bandwidth"`
		// PortMappings are the pod's host ports, passed when the conflist
		// declares the portMappings capability for kvipam (bpf datapath).
		PortMappings []api.PortMapping `json:"portMappings"`
	} `json:"runtimeConfig"`
	ValidAttachments []types.GCAttachment `json:"cni.dev/valid-attachments"`
	// Attachments is the name an early text of the spec used; libcni
	// sends both.
	Attachments []types.GCAttachment `json:"cni.dev/attachments"`
}

type pluginConf struct {
	common
	settings
	MTU int `json:"mtu"`
}

type ipamConf struct {
	common
	IPAM struct {
		Type string `json:"type"`
		settings
		GatewayV4      string         `json:"gatewayV4"`
		GatewayV6      string         `json:"gatewayV6"`
		Routes         []*types.Route `json:"routes"`
		AddressPrefix  string         `json:"addressPrefix"`
		PrefixLengthV4 int            `json:"prefixLengthV4"`
		PrefixLengthV6 int            `json:"prefixLengthV6"`
	} `json:"ipam"`
}

// ParseConfig parses and validates a kvipam plugin configuration. Its
// errors carry CNI code 6 (undecodable), 1 (unsupported cniVersion) or 7
// (invalid), and name the key at fault.
func ParseConfig(data []byte) (*Config, error) { return parseConfig(data, true) }

func parseConfig(data []byte, strictKeys bool) (*Config, error) {
	var raw pluginConf
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode network configuration: %w", err))
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode network configuration: %w", err))
	}
	c, err := parseKnown(obj, pluginKeys, "", strictKeys, raw.common, raw.settings)
	if err != nil {
		return nil, err
	}
	if _, ok := obj["ipMasq"]; ok {
		if strictKeys {
			return nil, errIPMasq
		}
		c.UnknownKey = errors.Join(c.UnknownKey, errIPMasq) // DEL tears down all the same
	}
	if raw.MTU != 0 && (raw.MTU < 576 || raw.MTU > 65535) {
		return nil, invalidConf("mtu %d is out of range 576-65535 (0 = the agent's)", raw.MTU)
	}
	c.MTU = raw.MTU
	return c, nil
}

// ParseIPAMConfig parses and validates the configuration a main plugin
// hands to kvipam-ipam: the kvipam keys are under "ipam". Errors are coded
// as for ParseConfig.
func ParseIPAMConfig(data []byte) (*Config, error) { return parseIPAMConfig(data, true) }

func parseIPAMConfig(data []byte, strictKeys bool) (*Config, error) {
	var raw ipamConf
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode network configuration: %w", err))
	}
	// Only "ipam" is kvipam's: the rest is the main plugin's.
	var top struct {
		IPAM json.RawMessage `json:"ipam"`
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil || (len(top.IPAM) > 0 && json.Unmarshal(top.IPAM, &obj) != nil) {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode network configuration: ipam is not an object"))
	}
	c, err := parseKnown(obj, ipamKeys, "ipam", strictKeys, raw.common, raw.IPAM.settings)
	if err != nil {
		return nil, err
	}
	for _, g := range []struct {
		key  string
		s    string
		want func(netip.Addr) bool
		dst  *netip.Addr
	}{
		{"ipam.gatewayV4", raw.IPAM.GatewayV4, netip.Addr.Is4, &c.GatewayV4},
		{"ipam.gatewayV6", raw.IPAM.GatewayV6, netip.Addr.Is6, &c.GatewayV6},
	} {
		if g.s == "" {
			continue
		}
		a, err := netip.ParseAddr(g.s)
		if err != nil || !g.want(a) || a.Is4In6() {
			return nil, invalidConf("%s %q is not an address of that family", g.key, g.s)
		}
		*g.dst = a
	}
	for i, r := range raw.IPAM.Routes {
		if r == nil || r.Dst.IP == nil || r.Dst.Mask == nil {
			return nil, invalidConf("ipam.routes[%d] has no dst", i)
		}
	}
	c.Routes = raw.IPAM.Routes
	switch raw.IPAM.AddressPrefix {
	case "", AddressPrefixBlock:
		c.AddressPrefix = AddressPrefixBlock
	case AddressPrefixHost:
		c.AddressPrefix = AddressPrefixHost
	default:
		return nil, invalidConf("ipam.addressPrefix %q is not %q or %q", raw.IPAM.AddressPrefix, AddressPrefixBlock, AddressPrefixHost)
	}
	if l := raw.IPAM.PrefixLengthV4; l < 0 || l > 32 {
		return nil, invalidConf("ipam.prefixLengthV4 %d is not 1-32 (0: addressPrefix decides)", l)
	}
	if l := raw.IPAM.PrefixLengthV6; l < 0 || l > 128 {
		return nil, invalidConf("ipam.prefixLengthV6 %d is not 1-128 (0: addressPrefix decides)", l)
	}
	c.PrefixLengthV4, c.PrefixLengthV6 = raw.IPAM.PrefixLengthV4, raw.IPAM.PrefixLengthV6
	return c, nil
}

// parseKnown is what the plugin's and the IPAM plugin's parsers share:
// obj's keys checked against known (an unknown one refused when strict,
// else kept in UnknownKey), the common keys, and kvipam's settings, which
// sit in section ("" at the top, "ipam").
func parseKnown(obj map[string]json.RawMessage, known []string, section string, strict bool, raw common, s settings) (*Config, error) {
	keysWhere, settingsWhere := "", ""
	if section != "" {
		keysWhere, settingsWhere = section+": ", section+"."
	}
	keyErr := checkKeys(obj, known, keysWhere)
	if keyErr != nil && strict {
		return nil, keyErr
	}
	if !strict {
		raw.RawPrevResult = nil // DEL does not read it
	}
	c, err := parseCommon(raw)
	if err != nil {
		return nil, err
	}
	c.UnknownKey = keyErr
	if err := c.applySettings(s, settingsWhere); err != nil {
		return nil, err
	}
	return c, nil
}

func parseCommon(raw common) (*Config, error) {
	if !slices.Contains(SupportedVersions, raw.CNIVersion) {
		return nil, withCode(types.ErrIncompatibleCNIVersion,
			fmt.Errorf("cniVersion %q is not supported (supported: %s)", raw.CNIVersion, strings.Join(SupportedVersions, ", ")))
	}
	if raw.Name == "" {
		return nil, invalidConf("name is empty")
	}
	c := &Config{CNIVersion: raw.CNIVersion, Name: raw.Name, DNS: raw.DNS}
	if bw := raw.RuntimeConfig.Bandwidth; bw != nil {
		c.EgressLimited = bw.EgressRate > 0 || bw.EgressBurst > 0
	}
	c.PortMappings = raw.RuntimeConfig.PortMappings
	ips, err := parseStaticIPs(raw.RuntimeConfig.IPs, "runtimeConfig.ips")
	if err != nil {
		return nil, err
	}
	c.IPs = ips
	if err := c.applyAnnotations(raw.RuntimeConfig.PodAnnotations); err != nil {
		return nil, err
	}
	if raw.RawPrevResult != nil {
		if c.PrevResult, err = parsePrevResult(raw.CNIVersion, raw.RawPrevResult); err != nil {
			return nil, err
		}
	}
	att := raw.ValidAttachments
	if att == nil {
		att = raw.Attachments
	}
	if att != nil {
		c.ValidAttachments = make([]api.Attachment, 0, len(att))
		for _, a := range att {
			c.ValidAttachments = append(c.ValidAttachments, api.Attachment{ContainerID: a.ContainerID, IfName: a.IfName})
		}
	}
	return c, nil
}

// applySettings validates the kvipam keys; prefix is "ipam." when they
// sit under "ipam", so errors name the key as the user wrote it.
func (c *Config) applySettings(s settings, prefix string) error {
	c.Socket = s.AgentSocket
	if c.Socket == "" {
		c.Socket = DefaultAgentSocket
	}
	// sun_path holds 108 bytes with the terminating NUL.
	if !filepath.IsAbs(c.Socket) || len(c.Socket) > 107 {
		return invalidConf("%sagentSocket %q must be an absolute path of at most 107 bytes", prefix, s.AgentSocket)
	}
	if s.Pool != "" {
		if err := validPoolName(s.Pool); err != nil {
			return invalidConf("%spool %q: %v", prefix, s.Pool, err)
		}
	}
	c.Pool = s.Pool
	for i, f := range s.Families {
		fam, err := allocator.ParseFamily(f)
		if err != nil {
			return invalidConf("%sfamilies[%d] %q is not ipv4 or ipv6", prefix, i, f)
		}
		if slices.Contains(c.Families, fam.String()) {
			return invalidConf("%sfamilies lists %s twice", prefix, fam)
		}
		c.Families = append(c.Families, fam.String())
	}
	c.AgentTimeout = DefaultAgentTimeout
	if s.AgentTimeout != "" {
		d, err := time.ParseDuration(s.AgentTimeout)
		if err != nil || d <= 0 || d > maxAgentTimeout {
			return invalidConf("%sagentTimeout %q must be a duration between 0 and %s, like \"10s\"", prefix, s.AgentTimeout, maxAgentTimeout)
		}
		c.AgentTimeout = d
	}
	c.DelQueueDir = s.DelQueueDir
	if c.DelQueueDir == "" {
		c.DelQueueDir = DefaultDelQueueDir
	}
	if !filepath.IsAbs(c.DelQueueDir) {
		return invalidConf("%sdelQueueDir %q must be an absolute path", prefix, s.DelQueueDir)
	}
	switch strings.ToLower(s.LogLevel) {
	case "", "off", "trace", "debug", "info", "warn", "error":
		c.LogLevel = strings.ToLower(s.LogLevel)
	default:
		return invalidConf("%slogLevel %q is not one of off, trace, debug, info, warn, error", prefix, s.LogLevel)
	}
	if s.LogFile != "" && !filepath.IsAbs(s.LogFile) {
		return invalidConf("%slogFile %q must be an absolute path", prefix, s.LogFile)
	}
	c.LogFile = s.LogFile
	return nil
}

// validPoolName applies the agent's rule for pool names, so a typo fails
// at parse time with code 7 rather than at the agent.
func validPoolName(name string) error {
	if len(name) > 63 {
		return fmt.Errorf("longer than 63 characters")
	}
	if name[0] == '-' {
		return fmt.Errorf("must start with a letter or digit")
	}
	for _, r := range name {
		if !('a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '-') {
			return fmt.Errorf("has character %q; only a-z, 0-9 and '-' are allowed", r)
		}
	}
	return nil
}

// parseStaticIPs reads the "ips" capability: addresses, or addresses with
// a prefix length (the form runtimes send), at most one per family.
func parseStaticIPs(in []string, key string) ([]netip.Addr, error) {
	var out []netip.Addr
	for i, s := range in {
		s = strings.TrimSpace(s)
		a, err := netip.ParseAddr(s)
		if err != nil {
			p, perr := netip.ParsePrefix(s)
			if perr != nil {
				return nil, invalidConf("%s[%d] %q is not an IP address", key, i, s)
			}
			a = p.Addr()
		}
		if a.Zone() != "" || a.Is4In6() {
			return nil, invalidConf("%s[%d] %q: zones and IPv4-mapped addresses are not allowed", key, i, s)
		}
		if slices.ContainsFunc(out, func(b netip.Addr) bool { return b.Is4() == a.Is4() }) {
			return nil, invalidConf("%s has more than one IPv%d address", key, map[bool]int{true: 4, false: 6}[a.Is4()])
		}
		out = append(out, a)
	}
	return out, nil
}

// errIPMasq refuses the CNI spec's ipMasq key, whatever its value: whether
// a pod's traffic is masqueraded is its pool's setting in etcd, the same
// for every pod of the pool on every node, and one conflist serves pods
// of many pools whose settings an operator changes without touching it.
// No value of the key can be honoured (true contradicts a pool that does
// not masquerade, false one that does, and one that agrees today may not
// tomorrow); ignoring it would tell its writer something untrue.
var errIPMasq = invalidConf("ipMasq: kvipam does not masquerade per network: egress masquerade is each pool's setting in etcd " +
	"(kvipamctl pool set-masquerade POOL on|off|default; by default on with routing host-gw and vxlan, off with bgp; docs/routing.md, \"Egress\"); remove ipMasq from the configuration")

func invalidConf(format string, args ...any) error {
	return withCode(types.ErrInvalidNetworkConfig, fmt.Errorf("invalid network configuration: "+format, args...))
}

// stickyText is a window as the agent's API takes it; "" for none.
func stickyText(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return d.String()
}
