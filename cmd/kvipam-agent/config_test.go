package main

import (
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/routing/bgp"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestLoadPrecedence(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(file, []byte(`
node: from-file
leaseTTL: 20s
mtu: 1400
etcd:
  endpoints: ["http://10.0.0.1:2379"]
pools:
- name: default
  cidrs: ["10.244.0.0/16", "fd00:244::/64"]
  blockSizeV4: 26
  blockSizeV6: 120
  reserved:
  - {range: 10.244.0.1-10.244.0.9, reason: routers}
  - {range: "fd00:244::/120"}
  reuseCooldown: 45s
`), 0o600))

	c, err := loadConfig([]string{"--config", file}, env(nil))
	require.NoError(t, err)
	require.Equal(t, "from-file", c.Node)
	require.Equal(t, 20*time.Second, c.LeaseTTL.Duration)
	require.Equal(t, []string{"http://10.0.0.1:2379"}, c.Etcd.Endpoints)
	require.Len(t, c.Pools, 1)
	require.Len(t, c.Pools[0].Reserved, 2, "reserved ranges in the pool configuration")
	require.Equal(t, "10.244.0.1-10.244.0.9", c.Pools[0].Reserved[0].Range.String())
	require.Equal(t, "routers", c.Pools[0].Reserved[0].Reason)
	require.Equal(t, "fd00:244::/120", c.Pools[0].Reserved[1].Range.String())
	require.Equal(t, 45*time.Second, c.Pools[0].Cooldown(), "a seeded pool may carry its reuse cooldown")

	c, err = loadConfig([]string{"--config", file, "--node", "from-flag"}, env(map[string]string{"KVIPAM_NODE": "from-env", "KVIPAM_MTU": "9000"}))
	require.NoError(t, err)
	require.Equal(t, "from-flag", c.Node, "flags beat the environment")
	require.Equal(t, 9000, c.MTU, "the environment beats the file")

	c, err = loadConfig(nil, env(map[string]string{"KVIPAM_CONFIG": file}))
	require.NoError(t, err)
	require.Equal(t, "from-file", c.Node, "KVIPAM_CONFIG names the file")
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("nodee: typo\n"), 0o600))
	moved := filepath.Join(dir, "moved.yaml")
	require.NoError(t, os.WriteFile(moved, []byte("reuseCooldown: 45s\n"), 0o600))
	maxBlocks := filepath.Join(dir, "maxblocks.yaml")
	require.NoError(t, os.WriteFile(maxBlocks, []byte("etcd: {embedded: true}\npools:\n- name: p\n  cidrs: [10.0.0.0/16]\n  blockSizeV4: 24\n  maxBlocksPerNode: 2\n"), 0o600))
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"unknown yaml field", []string{"--config", bad}, nil, "nodee"},
		{"missing file", []string{"--config", filepath.Join(dir, "nope.yaml")}, nil, "read config"},
		{"bad pool flag", []string{"--pool", "nocidr"}, nil, "NAME=CIDR"},
		{"bad env", nil, map[string]string{"KVIPAM_MTU": "big"}, "KVIPAM_MTU"},
		{"two errors at once", []string{"--pool", "p=10.0.0.0/16", "--mtu", "10", "--datapath", "x"}, nil, "mtu: 10"},
		{"stray argument", []string{"--pool", "p=10.0.0.0/16", "extra"}, nil, "unexpected arguments"},
		{"reuse-cooldown flag", []string{"--reuse-cooldown", "0s"}, nil, "kvipamctl pool set-cooldown"},
		{"reuse-cooldown env", nil, map[string]string{"KVIPAM_REUSE_COOLDOWN": "0s"}, "KVIPAM_REUSE_COOLDOWN=\"0s\": reuse-cooldown is no longer an agent setting"},
		{"reuse-cooldown key", []string{"--config", moved}, nil, "reuse-cooldown is no longer an agent setting"},
		{"max-blocks key", []string{"--config", maxBlocks}, nil, "pool p: maxBlocksPerNode is not an agent setting: set it with kvipamctl pool set-max-blocks"},
		{"cert without key", []string{"--pool", "p=10.0.0.0/16", "--etcd-endpoints", "http://e:2379", "--etcd-cert", "c.pem"}, nil, "keyFile"},
		{"embedded with a certificate", []string{"--etcd-embedded", "--etcd-cert", "c.pem", "--etcd-key", "k.pem"}, nil, "the embedded etcd takes none"},
		{"no etcd", []string{"--pool", "p=10.0.0.0/16"}, nil, "no endpoints, and no embedded etcd asked for"},
		{"non-masquerade cidr with host bits", []string{"--etcd-embedded", "--non-masquerade-cidrs", "10.0.0.0/8,192.168.1.1/16"}, nil, "egress.nonMasqueradeCIDRs: 192.168.1.1/16 has host bits set, did you mean 192.168.0.0/16"},
		{"non-masquerade cidr not a cidr", []string{"--etcd-embedded", "--non-masquerade-cidrs", "10.0.0.0"}, nil, "non-masquerade-cidrs: netip.ParsePrefix(\"10.0.0.0\"): no '/'"},
		{"both etcds", []string{"--etcd-endpoints", "http://e:2379"}, map[string]string{"KVIPAM_ETCD_EMBEDDED": "true"}, "both endpoints (http://e:2379) and embedded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := loadConfig(tc.args, env(tc.env))
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// The example configuration shipped in deploy/ must load.
func TestShippedConfigLoads(t *testing.T) {
	c, err := loadConfig([]string{"--config", "../../deploy/config/agent.yaml", "--node", "n1"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, "default", c.Pools[0].Name)
	require.Len(t, c.Etcd.Endpoints, 3)
}

// TestConfigWrittenLoads: a configuration marshalled from the agent's own
// type (as tools and benchmarks write it) loads back: a routing without
// BGP writes no bgp section, whose zero AS the strict reader would refuse.
func TestConfigWrittenLoads(t *testing.T) {
	c := agent.DefaultConfig()
	c.Node = "n1"
	c.Etcd.Endpoints = []string{"http://127.0.0.1:2379"}
	data, err := json.Marshal(c)
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "agent.json")
	require.NoError(t, os.WriteFile(file, data, 0o600))
	got, err := loadConfig([]string{"--config", file}, env(nil))
	require.NoError(t, err)
	require.Equal(t, "n1", got.Node)
}

// Node labels come from --node-labels, KVIPAM_NODE_LABELS or nodeLabels
// in the file; no pool is needed.
func TestNodeLabels(t *testing.T) {
	c, err := loadConfig([]string{"--node", "n1", "--etcd-embedded", "--node-labels", "rack=r1, zone=a"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"rack": "r1", "zone": "a"}, c.NodeLabels)
	require.Empty(t, c.Pools)
	c, err = loadConfig([]string{"--node", "n1"}, env(map[string]string{"KVIPAM_NODE_LABELS": "gpu=", "KVIPAM_ETCD_EMBEDDED": "true"}))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"gpu": ""}, c.NodeLabels)
	file := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(file, []byte("node: n1\netcd: {embedded: true}\nnodeLabels: {rack: r2}\npools:\n- {name: r2, cidrs: [10.9.0.0/24], blockSizeV4: 28, nodeSelector: rack=r2}\n"), 0o600))
	c, err = loadConfig([]string{"--config", file}, env(nil))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"rack": "r2"}, c.NodeLabels)
	require.Equal(t, "rack=r2", c.Pools[0].NodeSelector)
	_, err = loadConfig([]string{"--node", "n1", "--node-labels", "rack=r 1"}, env(nil))
	require.ErrorContains(t, err, "node-labels")
}

// TestEgressConfig: the destinations never masqueraded come from the
// file's egress section, KVIPAM_NON_MASQUERADE_CIDRS or the flag (which
// wins); a pool in the file may carry its masquerade setting.
func TestEgressConfig(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(file, []byte("node: n1\netcd: {embedded: true}\negress: {nonMasqueradeCIDRs: [192.168.0.0/16, 'fd00:1::/64']}\n"+
		"pools:\n- {name: p, cidrs: [10.9.0.0/24], blockSizeV4: 28, masquerade: false}\n"), 0o600))
	c, err := loadConfig([]string{"--config", file}, env(nil))
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("fd00:1::/64")}, c.Egress.NonMasqueradeCIDRs)
	require.NotNil(t, c.Pools[0].Masquerade)
	require.False(t, *c.Pools[0].Masquerade)
	c, err = loadConfig([]string{"--config", file, "--non-masquerade-cidrs", "172.16.0.0/12"}, env(map[string]string{"KVIPAM_NON_MASQUERADE_CIDRS": "10.0.0.0/8"}))
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{netip.MustParsePrefix("172.16.0.0/12")}, c.Egress.NonMasqueradeCIDRs)
	_, err = loadConfig([]string{"--config", file}, env(map[string]string{"KVIPAM_NON_MASQUERADE_CIDRS": "10.0.0.0/8, 100.64.0.0/10"}))
	require.NoError(t, err)
}

// TestBGPConfig: routing bgp reads its speaker from the file's bgp
// section; an unknown key in it (a typo, or a setting kvipam does not
// have) is an error naming the key, and so is a bgp section without
// routing bgp, or a peer missing what it needs.
func TestBGPConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		f := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(f, []byte(body), 0o600))
		return f
	}
	good := write("good.yaml", `
node: n1
etcd: {endpoints: ["http://10.0.0.1:2379"]}
routing: bgp
pools: [{name: default, cidrs: ["10.244.0.0/16"], blockSizeV4: 26}]
bgp:
  asn: 65001
  communities: ["65001:100", no-export]
  localPref: 200
  restartTime: 7s
  peers:
  - {address: 10.0.0.1, asn: 65000, password: s3cret, holdTime: 9s, keepaliveTime: 3s, nodes: ["rack1-*"], communities: ["65001:300"], localPref: 300}
  - {address: "fd00::1", asn: 65000}
`)
	c, err := loadConfig([]string{"--config", good}, env(nil))
	require.NoError(t, err)
	require.NoError(t, c.Validate())
	require.Equal(t, bgp.ASN(65001), c.BGP.ASN)
	require.Len(t, c.BGP.Peers, 2)
	require.Equal(t, "s3cret", c.BGP.Peers[0].Password)
	require.Equal(t, 9*time.Second, c.BGP.Peers[0].HoldTime.Duration)
	require.Len(t, c.BGP.PeersFor("rack1-n3"), 2)
	require.Len(t, c.BGP.PeersFor("rack2-n1"), 1, "the first router is rack 1's only")

	unknown := write("unknown.yaml", `
node: n1
routing: bgp
pools: [{name: default, cidrs: ["10.244.0.0/16"], blockSizeV4: 26}]
bgp:
  asn: 65001
  peers:
  - {address: 10.0.0.1, asn: 65000, ebgpMultihop: 2}
`)
	_, err = loadConfig([]string{"--config", unknown}, env(nil))
	require.ErrorContains(t, err, `bgp.peers[0].ebgpMultihop: unknown key`)

	// Issue 44: docs/routing.md says a typo such as holdtime is refused;
	// in a peer's section and in the bgp section alike, with the key it
	// was meant to be. An AS number out of range is refused by its key,
	// with the reason, not by the decoder.
	for _, tc := range []struct{ name, bgp, want string }{
		{"peer holdtime", "{asn: 65001, peers: [{address: 10.0.0.1, asn: 65000, holdtime: 9s}]}", "bgp.peers[0].holdtime: unknown key (did you mean holdTime?)"},
		{"peer keepalive", "{asn: 65001, peers: [{address: 10.0.0.1, asn: 65000, keepalive: 3s}]}", "bgp.peers[0].keepalive: unknown key"},
		{"bgp holdtime", "{asn: 65001, holdTime: 9s, peers: [{address: 10.0.0.1, asn: 65000}]}", "bgp.holdTime: unknown key (did you mean bgp.peers[].holdTime?)"},
		{"bgp listenport", "{asn: 65001, listenport: 179, peers: [{address: 10.0.0.1, asn: 65000}]}", "bgp.listenport: unknown key (did you mean listenPort?)"},
		{"asn too big", "{asn: 4294967296, peers: [{address: 10.0.0.1, asn: 65000}]}", "bgp.asn: 4294967296 is not an AS number: at most 4294967294"},
		{"peer as_trans", "{asn: 65001, peers: [{address: 10.0.0.1, asn: 23456}]}", "bgp.peers[0].asn: 23456 is not a usable AS number: AS_TRANS"},
		{"peer asn zero", "{asn: 65001, peers: [{address: 10.0.0.1, asn: 0}]}", "bgp.peers[0].asn: 0 is not a usable AS number"},
	} {
		f := write(tc.name+".yaml", "node: n1\nrouting: bgp\npools: [{name: default, cidrs: [\"10.244.0.0/16\"], blockSizeV4: 26}]\nbgp: "+tc.bgp+"\n")
		_, err := loadConfig([]string{"--config", f}, env(nil))
		require.ErrorContains(t, err, tc.want, tc.name)
		require.NotContains(t, err.Error(), "cannot unmarshal", tc.name)
	}

	for _, tc := range []struct{ name, body, want string }{
		{"no-routing", "bgp: {asn: 65001, peers: [{address: 10.0.0.1, asn: 65000}]}\n", `routing is "host-gw"`},
		{"no-asn", "routing: bgp\nbgp: {peers: [{address: 10.0.0.1, asn: 65000}]}\n", "bgp: asn: required"},
		{"no-peers", "routing: bgp\nbgp: {asn: 65001}\n", "bgp: peers: at least one"},
		{"bad-peer", "routing: bgp\nbgp: {asn: 65001, peers: [{address: router1, holdTime: 1s}]}\n", "peers[0].address"},
		{"bad-community", "routing: bgp\nbgp: {asn: 65001, communities: [\"70000:1\"], peers: [{address: 10.0.0.1, asn: 65000}]}\n", "community"},
		{"restart-outlives-lease", "routing: bgp\nbgp: {asn: 65001, restartTime: 60s, peers: [{address: 10.0.0.1, asn: 65000}]}\n", "bgp.restartTime: 1m0s is more than 7s, half the lease TTL"},
	} {
		f := write(tc.name+".yaml", "node: n1\npools: [{name: default, cidrs: [\"10.244.0.0/16\"], blockSizeV4: 26}]\n"+tc.body)
		c, err := loadConfig([]string{"--config", f}, env(nil))
		if err == nil {
			err = c.Validate()
		}
		require.ErrorContains(t, err, tc.want, tc.name)
	}
}

// TestEtcdSectionUnknownKeyRefused: a misspelt key is refused at every
// depth of the file, the etcd section's included (issue 43: `endpoint:`
// for `endpoints:` was ignored, and the agent ran a private etcd), naming
// the key by its path and the key it was probably meant to be. Durations
// are written as the flags take them.
func TestEtcdSectionUnknownKeyRefused(t *testing.T) {
	dir := t.TempDir()
	load := func(body string) (error, time.Duration, time.Duration) {
		t.Helper()
		f := filepath.Join(dir, "agent.yaml")
		require.NoError(t, os.WriteFile(f, []byte("node: n1\n"+body), 0o600))
		c, err := loadConfig([]string{"--config", f}, env(nil))
		return err, c.Etcd.CallTimeout.Duration, c.Etcd.DialTimeout.Duration
	}
	for _, tc := range []struct{ name, body, path, suggest string }{
		{"etcd endpoint", "etcd: {endpoint: [\"http://10.0.0.1:2379\"]}\n", "etcd.endpoint", "endpoints"},
		{"etcd case", "etcd: {endpoints: [\"http://10.0.0.1:2379\"], calltimeout: 1s}\n", "etcd.calltimeout", "callTimeout"},
		{"top level flag name", "etcd: {embedded: true}\nlease-ttl: 20s\n", "lease-ttl", "leaseTTL"},
		{"top level in the wrong section", "etcd: {embedded: true}\nendpoints: [\"http://10.0.0.1:2379\"]\n", "endpoints", "etcd.endpoints"},
		{"vxlan", "etcd: {embedded: true}\nvxlan: {vnii: 7}\n", "vxlan.vnii", "vni"},
		{"pool", "etcd: {embedded: true}\npools: [{name: p, cidr: [10.0.0.0/16]}]\n", "pools[0].cidr", "cidrs"},
		{"reserved range", "etcd: {embedded: true}\npools: [{name: p, cidrs: [10.0.0.0/16], reserved: [{rage: 10.0.0.1}]}]\n", "pools[0].reserved[0].rage", "range"},
		{"bgp peer", "etcd: {embedded: true}\nrouting: bgp\nbgp: {asn: 65001, peers: [{address: 10.0.0.1, asn: 65000}, {adress: 10.0.0.2, asn: 65000}]}\n", "bgp.peers[1].adress", "address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err, _, _ := load(tc.body)
			require.Error(t, err)
			require.ErrorContains(t, err, tc.path+": unknown key")
			require.ErrorContains(t, err, "did you mean "+tc.suggest+"?")
		})
	}
	t.Run("two unknown keys at once", func(t *testing.T) {
		err, _, _ := load("etcd: {endpoint: [\"http://10.0.0.1:2379\"], dialtimeout: 5s}\nmttu: 1400\n")
		require.ErrorContains(t, err, "etcd.endpoint: unknown key")
		require.ErrorContains(t, err, "etcd.dialtimeout: unknown key")
		require.ErrorContains(t, err, "mttu: unknown key (did you mean mtu?)")
	})
	t.Run("durations as the flags write them", func(t *testing.T) {
		err, call, dial := load("etcd: {endpoints: [\"http://10.0.0.1:2379\"], callTimeout: 1s, dialTimeout: 5s}\n")
		require.NoError(t, err)
		require.Equal(t, time.Second, call)
		require.Equal(t, 5*time.Second, dial)
		err, _, _ = load("etcd: {endpoints: [\"http://10.0.0.1:2379\"], callTimeout: 1}\n")
		require.ErrorContains(t, err, "etcd.callTimeout: 1 has no unit")
		err, _, _ = load("etcd: {endpoints: [\"http://10.0.0.1:2379\"]}\nleaseTTL: 20\n")
		require.ErrorContains(t, err, "leaseTTL: 20 has no unit")
		err, _, _ = load("etcd: {endpoints: [\"http://10.0.0.1:2379\"]}\nbgp: {peers: [{holdTime: 9}]}\n")
		require.ErrorContains(t, err, "bgp.peers[0].holdTime: 9 has no unit")
	})
}

// TestEtcdEndpointsFromKvipamctlsVariable: the agent reads its etcd
// endpoints from KVIPAM_ETCD_ENDPOINTS, the variable kvipamctl documents
// (docs/kvipamctl.md), with the precedence of its other settings: the
// flag beats the variable, which beats the file.
func TestEtcdEndpointsFromKvipamctlsVariable(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(file, []byte("etcd:\n  endpoints: [\"http://10.0.0.1:2379\"]\n"), 0o600))
	vars := map[string]string{"KVIPAM_ETCD_ENDPOINTS": "http://10.0.0.2:2379,http://10.0.0.3:2379"}

	c, err := loadConfig([]string{"--pool", "p=10.0.0.0/16"}, env(vars))
	require.NoError(t, err)
	require.Equal(t, []string{"http://10.0.0.2:2379", "http://10.0.0.3:2379"}, c.Etcd.Endpoints, "the variable alone")

	c, err = loadConfig([]string{"--config", file}, env(vars))
	require.NoError(t, err)
	require.Equal(t, []string{"http://10.0.0.2:2379", "http://10.0.0.3:2379"}, c.Etcd.Endpoints, "the variable beats the file")

	c, err = loadConfig([]string{"--config", file, "--etcd-endpoints", "http://10.0.0.4:2379"}, env(vars))
	require.NoError(t, err)
	require.Equal(t, []string{"http://10.0.0.4:2379"}, c.Etcd.Endpoints, "the flag beats the variable")
}
