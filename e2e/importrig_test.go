package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
)

// The adoption rig: a node whose pods were made by bridge with the real
// host-local (the "hlnet" network, host-local's files under the test's
// own data directory), with kvipam's agent running beside them and a pool
// that covers host-local's range. The conflist is switched to bridge with
// kvipam-ipam after the import.

const (
	importNet    = "hlnet"
	importPool   = "hl"
	importBridge = "kvbr1"
)

var (
	importRange   = netip.MustParsePrefix("10.3.1.0/24")
	importGateway = netip.MustParseAddr("10.3.1.1") // bridge's isGateway address
)

type importRig struct {
	t       *testing.T
	n       *node
	dataDir string // host-local's dataDir; its files are under dataDir/hlnet
	old     *libcni.NetworkConfigList
	kv      *libcni.NetworkConfigList // the switched conflist
}

// newImportRig starts the node's agent (blocks of blockV4) with pool hl,
// reserves host-local's gateway in it, and prepares the bridge.
func newImportRig(t *testing.T, name string, blockV4 int) *importRig {
	n := newNode(t, name)
	n.startAgent(agentOpts{pools: []string{importPool + "=10.3.0.0/16"}, blockV4: blockV4})
	r := &importRig{t: t, n: n, dataDir: filepath.Join(n.dir, "host-local")}
	// As deploy/cni/README.md asks for bridge with kvipam-ipam: a fixed
	// MAC and the pool routed to the bridge (the pods' link-local
	// gateway comes with the switch: bridge with isGateway refuses a
	// bridge with another address).
	h := nlHandle(t, n.host)
	la := netlink.NewLinkAttrs()
	la.Name = importBridge
	la.HardwareAddr = net.HardwareAddr{0x02, 0x6b, 0x76, 0x00, 0x00, 0x02}
	br := &netlink.Bridge{LinkAttrs: la}
	require.NoError(t, h.LinkAdd(br))
	require.NoError(t, h.LinkSetUp(br))
	require.NoError(t, h.RouteAdd(&netlink.Route{LinkIndex: br.Attrs().Index, Dst: ipNet(netip.MustParsePrefix("10.3.0.0/16")), Scope: netlink.SCOPE_LINK}))
	r.old = conflist(t, fmt.Sprintf(`{"cniVersion":"1.1.0","name":%q,"plugins":[{"type":"bridge","bridge":%q,"isGateway":true,
		"ipam":{"type":"host-local","ranges":[[{"subnet":%q}]],"dataDir":%q}}]}`, importNet, importBridge, importRange, r.dataDir))
	r.kv = conflist(t, fmt.Sprintf(`{"cniVersion":"1.1.0","name":%q,"plugins":[{"type":"bridge","bridge":%q,"capabilities":{"ips":true},
		"ipam":{"type":"kvipam-ipam","pool":%q,"agentSocket":%q,"delQueueDir":%q}}]}`, importNet, importBridge, importPool, n.socket, n.queue))
	// host-local's gateway is the bridge's: kvipam must never hand it out.
	r.ctlOK("pool", "reserve", importPool, importGateway.String(), "--reason", "host-local gateway")
	r.awaitImportLevel()
	return r
}

// hostLocalDir is host-local's directory of the network.
func (r *importRig) hostLocalDir() string { return filepath.Join(r.dataDir, importNet) }

// ctl runs kvipamctl in the node namespace against the agent's etcd,
// with env added to its environment.
func (r *importRig) ctl(env []string, args ...string) (string, error) {
	args = append(args, "--endpoints", r.n.etcdEndpoint())
	cmd := exec.Command(filepath.Join(r.n.bin, "kvipamctl"), args...)
	cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := r.n.do(cmd.Run)
	return out.String(), err
}

func (r *importRig) ctlOK(args ...string) string {
	r.t.Helper()
	out, err := r.ctl(nil, args...)
	require.NoError(r.t, err, "kvipamctl %s:\n%s", strings.Join(args, " "), out)
	return out
}

// importArgs are kvipamctl import host-local's arguments for the rig.
func (r *importRig) importArgs(more ...string) []string {
	return append([]string{"import", "host-local", "--node", r.n.name, "--pool", importPool, "--dir", r.hostLocalDir()}, more...)
}

// source is the rig's import source ID.
func (r *importRig) source() string { return "host-local:" + r.n.name + ":" + importNet }

// etcd is a client of the agent's embedded etcd, dialled from the node
// namespace, closed at cleanup.
func (r *importRig) etcd() *clientv3.Client {
	r.t.Helper()
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		var c net.Conn
		err := r.n.host.Do(func(ns.NetNS) (err error) {
			var d net.Dialer
			c, err = d.DialContext(ctx, "tcp", addr)
			return err
		})
		return c, err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{r.n.etcdEndpoint()}, DialTimeout: 10 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithContextDialer(dial)}})
	require.NoError(r.t, err)
	r.t.Cleanup(func() { cli.Close() })
	return cli
}

// awaitImportLevel waits until the agent raised the cluster's schema
// level to one with the import feature (it does once every live node
// understands it).
func (r *importRig) awaitImportLevel() {
	st := etcdstore.New(r.etcd(), etcdstore.Options{})
	waitFor(r.t, 60*time.Second, "the schema level with import", func() bool {
		set, err := st.ReadSchema(context.Background())
		return err == nil && set.Level >= schema.ImportNeeds()
	})
}

// addedPod is a pod and the address it got.
type addedPod struct {
	*pod
	addr netip.Addr
}

// addOld makes pods under host-local.
func (r *importRig) addOld(names ...string) []addedPod {
	var out []addedPod
	for _, name := range names {
		p := newPod(r.t, name)
		a, _ := podAddrs(r.t, r.n.mustAdd(r.old, p))
		require.True(r.t, importRange.Contains(a), "host-local's range: %s", a)
		out = append(out, addedPod{p, a})
	}
	return out
}

// switchConflist readies the node for the switched conflist: the pods'
// link-local gateway on the bridge (deploy/cni/README.md). The switched
// conflist is r.kv.
func (r *importRig) switchConflist() {
	h := nlHandle(r.t, r.n.host)
	br, err := h.LinkByName(importBridge)
	require.NoError(r.t, err)
	require.NoError(r.t, h.AddrAdd(br, &netlink.Addr{IPNet: ipNet(netip.MustParsePrefix("169.254.1.1/32"))}))
}

// addNewStatic makes a pod through the switched conflist with a static
// address (the "ips" capability).
func (r *importRig) addNewStatic(name string, a netip.Addr) addedPod {
	p := newPod(r.t, name)
	p.rt.CapabilityArgs = map[string]any{"ips": []string{a.String() + "/16"}}
	got, _ := podAddrs(r.t, r.n.mustAdd(r.kv, p))
	require.Equal(r.t, a, got)
	return addedPod{p, got}
}

// addNew makes pods through the switched conflist (kvipam-ipam).
func (r *importRig) addNew(names ...string) []addedPod {
	var out []addedPod
	for _, name := range names {
		p := newPod(r.t, name)
		a, _ := podAddrs(r.t, r.n.mustAdd(r.kv, p))
		out = append(out, addedPod{p, a})
	}
	return out
}

// imported reads the records of kvipam that an import wrote, by address.
func (r *importRig) imported() map[netip.Addr]records.Allocation {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := r.etcd().Get(ctx, etcdstore.IPsPrefix(importPool), clientv3.WithPrefix())
	require.NoError(r.t, err)
	out := map[netip.Addr]records.Allocation{}
	for _, kv := range resp.Kvs {
		al, err := etcdstore.DecodeAllocation(importPool, kv)
		require.NoError(r.t, err)
		if al.Imported != "" {
			out[al.Addr] = al
		}
	}
	return out
}

// awaitLearned waits until the node's agent holds p's address for p:
// it learned the import (its watch of import marks).
func (r *importRig) awaitLearned(ps ...addedPod) {
	r.t.Helper()
	for _, p := range ps {
		waitFor(r.t, 30*time.Second, "the agent to learn "+p.rt.ContainerID, func() bool {
			als, err := r.n.client().Allocations(context.Background(), api.Owner{ContainerID: p.rt.ContainerID, IfName: "eth0"})
			return err == nil && len(als) == 1 && als[0].Address.Addr() == p.addr
		})
	}
}

// importPlan runs a dry run and returns its plan.
func (r *importRig) importPlan() importPlanOut {
	r.t.Helper()
	out := r.ctlOK(append(r.importArgs("--dry-run"), "-o", "json")...)
	var pl importPlanOut
	require.NoError(r.t, json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &pl), out)
	return pl
}

// importPlanOut is the part of kvipamctl import -o json a test reads.
type importPlanOut struct {
	Source string `json:"source"`
	Blocks []struct {
		Block    netip.Prefix `json:"block"`
		Claimant string       `json:"claimant"`
		Action   string       `json:"action"`
		New      []struct {
			IP netip.Addr `json:"ip"`
		} `json:"new"`
		Already int `json:"already"`
	} `json:"blocks"`
	Written int  `json:"written"`
	DryRun  bool `json:"dryRun"`
}

// claims reads which blocks of the pool are claimed by the rig's node.
func (r *importRig) claims() map[netip.Prefix]bool {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	infos, err := etcdstore.New(r.etcd(), etcdstore.Options{}).ListBlocks(ctx, importPool)
	require.NoError(r.t, err)
	out := map[netip.Prefix]bool{}
	for _, bi := range infos {
		out[bi.Block] = bi.Owned(r.n.name)
	}
	return out
}
