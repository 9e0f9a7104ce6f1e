package cni

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

type pluginEnv struct {
	ag     *fakeAgent
	p      *Plugin
	out    *bytes.Buffer
	queue  string
	host   ns.NetNS
	pod    ns.NetNS
	stderr *bytes.Buffer
}

// newPluginEnv is a Plugin on a fake agent, with a scratch host and pod
// netns when root is needed.
func newPluginEnv(t *testing.T, withNS bool) *pluginEnv {
	t.Helper()
	e := &pluginEnv{ag: newFakeAgent(), out: &bytes.Buffer{}, stderr: &bytes.Buffer{}, queue: t.TempDir()}
	e.p = &Plugin{IO{Stdout: e.out, Stderr: e.stderr, NewAgent: func(string, time.Duration) Agent { return e.ag }}}
	if withNS {
		e.host, e.pod = newHostNS(t), newNS(t)
	}
	return e
}

func (e *pluginEnv) conf(extra string) []byte {
	return []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"pods","type":"kvipam","delQueueDir":%q,"logLevel":"debug"%s}`, e.queue, extra))
}

func (e *pluginEnv) args(id string, stdin []byte) *skel.CmdArgs {
	a := &skel.CmdArgs{ContainerID: id, IfName: "eth0", StdinData: stdin, Args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0"}
	if e.pod != nil {
		a.Netns = e.pod.Path()
	}
	return a
}

// run runs a command in the host netns, as a runtime runs the plugin.
func (e *pluginEnv) run(t *testing.T, f func(*skel.CmdArgs) error, a *skel.CmdArgs) error {
	t.Helper()
	if e.host == nil {
		return f(a)
	}
	return in(t, e.host, func() error { return f(a) })
}

func TestPluginAddCheckDel(t *testing.T) {
	e := newPluginEnv(t, true)
	e.ag.ips = append(e.ag.ips, api.IPConfig{Address: netip.MustParsePrefix("fd00::5/128"), Family: "ipv6", Gateway: api.GatewayV6})

	require.NoError(t, e.run(t, e.p.Add, e.args("c1", e.conf(`,"dns":{"nameservers":["10.96.0.10"]}`))))
	require.Equal(t, []string{
		"allocate c1/eth0 pool=\"\" permanent=false ips=[] ns=default pod=web-0",
		"endpoint c1/eth0 host=" + HostVethName("c1", "eth0") + " ips=[10.1.0.5/32 fd00::5/128]",
	}, e.ag.Calls())
	var res current.Result
	require.NoError(t, json.Unmarshal(e.out.Bytes(), &res))
	require.Equal(t, "1.0.0", res.CNIVersion)
	require.Len(t, res.Interfaces, 2)
	require.Equal(t, e.pod.Path(), res.Interfaces[1].Sandbox)
	require.Len(t, res.IPs, 2)
	require.Equal(t, []string{"10.96.0.10"}, res.DNS.Nameservers)
	l, err := handle(t, e.pod).LinkByName("eth0")
	require.NoError(t, err)
	require.Equal(t, 1450, l.Attrs().MTU, "the agent's MTU")
	hl, err := handle(t, e.host).LinkByName(HostVethName("c1", "eth0"))
	require.NoError(t, err)
	require.Equal(t, 1450, hl.Attrs().MTU, "the agent's MTU on the host end (the veth is made before the answer)")

	check := e.conf(`,"prevResult":` + e.out.String())
	require.NoError(t, e.run(t, e.p.Check, e.args("c1", check)))

	// The agent lost the endpoint (its IPs were released): CHECK fails.
	e.ag.eps = map[string]api.Endpoint{}
	err = e.run(t, e.p.Check, e.args("c1", check))
	require.ErrorContains(t, err, "no endpoint for c1/eth0")

	require.NoError(t, e.run(t, e.p.Del, e.args("c1", e.conf(""))))
	_, err = handle(t, e.host).LinkByName(HostVethName("c1", "eth0"))
	require.Error(t, err, "DEL removed the veth")
	a := e.args("c1", e.conf(""))
	a.Netns = ""
	require.NoError(t, e.run(t, e.p.Del, a), "a second DEL, without netns, succeeds")
	calls := e.ag.Calls()
	require.Equal(t, "release c1/eth0", calls[len(calls)-1])
}

func TestPluginAddFailures(t *testing.T) {
	tests := []struct {
		name        string
		prepare     func(e *pluginEnv, a *skel.CmdArgs)
		wantCode    uint
		wantMsg     string
		wantRelease bool
		wantQueued  bool
		// podIfTaken: the pod's interface name is held by the test's own.
		podIfTaken bool
	}{
		{
			name:     "agent never ready",
			prepare:  func(e *pluginEnv, _ *skel.CmdArgs) { e.ag.allocateDown, e.ag.errWait = 1, unreachable() },
			wantCode: types.ErrTryAgainLater, wantMsg: "kvipam agent not ready after 10s",
		},
		{
			name: "pool exhausted",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.errAllocate = &api.Error{Code: api.CodeExhausted, Message: "pool default exhausted (ipv4): 64 of 64 blocks claimed"}
			},
			wantCode: ErrCodePoolExhausted, wantMsg: "pool default exhausted (ipv4): 64 of 64 blocks claimed",
		},
		{
			name: "static ip taken",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.errAllocate = &api.Error{Code: api.CodeInUse, Message: "10.1.0.9 is held by c9/eth0"}
			},
			wantCode: ErrCodeAddressInUse, wantMsg: "10.1.0.9 is held by c9/eth0",
		},
		{
			name: "endpoint create fails",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.errEndpoint = &api.Error{Code: api.CodeInternal, Message: "program datapath: boom"}
			},
			wantCode: types.ErrInternal, wantMsg: "create endpoint for c1/eth0: program datapath: boom", wantRelease: true,
		},
		{
			name: "etcd lost during endpoint create",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.errEndpoint = &api.Error{Code: api.CodeTryAgain, Message: "node lease lost"}
			},
			wantCode: types.ErrTryAgainLater, wantMsg: "node lease lost", wantRelease: true,
		},
		{
			name: "agent gone before the rollback",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.errEndpoint = fmt.Errorf("post: %w", unreachable())
				e.ag.errRelease = unreachable()
			},
			wantCode: types.ErrTryAgainLater, wantMsg: "create endpoint", wantRelease: true, wantQueued: true,
		},
		{
			name: "bad allocation answer",
			prepare: func(e *pluginEnv, _ *skel.CmdArgs) {
				e.ag.ips = []api.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/32"), Gateway: api.GatewayV6}}
			},
			wantCode: types.ErrInternal, wantMsg: "agent answered gateway fe80::ecee:eeff:feee:eeee for 10.1.0.5/32", wantRelease: true,
		},
		{
			// The veth is made while the agent allocates: when it cannot
			// be, the reservation made meanwhile is released.
			name:     "pod interface name taken",
			prepare:  func(*pluginEnv, *skel.CmdArgs) {},
			wantCode: types.ErrInternal, wantMsg: "interface eth0 already exists", wantRelease: true, podIfTaken: true,
		},
		{
			name:     "netns missing: nothing is allocated",
			prepare:  func(_ *pluginEnv, a *skel.CmdArgs) { a.Netns = "/var/run/netns/none-such" },
			wantCode: types.ErrInvalidEnvironmentVariables, wantMsg: "CNI_NETNS",
		},
		{
			name:     "bad CNI_ARGS",
			prepare:  func(_ *pluginEnv, a *skel.CmdArgs) { a.Args = "K8S_POD_NAME=x;FOO=bar" },
			wantCode: types.ErrInvalidEnvironmentVariables, wantMsg: "CNI_ARGS",
		},
		{
			name:     "chained after another plugin",
			prepare:  func(e *pluginEnv, a *skel.CmdArgs) { a.StdinData = e.conf(`,"prevResult":{"cniVersion":"1.0.0"}`) },
			wantCode: types.ErrInvalidNetworkConfig, wantMsg: "first plugin",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newPluginEnv(t, true)
			a := e.args("c1", e.conf(""))
			tt.prepare(e, a)
			var taken netlink.Link
			if tt.podIfTaken {
				taken = nstest.AddLink(t, handle(t, e.pod), "eth0")
			}
			err := e.run(t, e.p.Funcs().Add, a)
			var te *types.Error
			require.ErrorAs(t, err, &te)
			require.Equal(t, tt.wantCode, te.Code, "error: %v", te)
			require.Contains(t, te.Msg, tt.wantMsg)
			require.Empty(t, e.out.String(), "no result on failure")

			calls := strings.Join(e.ag.Calls(), "\n")
			require.Equal(t, tt.wantRelease, strings.Contains(calls, "release c1/eth0"), "calls:\n%s", calls)
			_, err = handle(t, e.host).LinkByName(HostVethName("c1", "eth0"))
			require.Error(t, err, "no veth is left behind")
			podIf, err := handle(t, e.pod).LinkByName("eth0")
			if tt.podIfTaken {
				require.NoError(t, err)
				require.Equal(t, taken.Attrs().Index, podIf.Attrs().Index, "the pod's own interface was left alone")
			} else {
				require.Error(t, err, "no pod interface is left behind")
			}
			queued, err := delqueue.List(e.queue)
			require.NoError(t, err)
			require.Equal(t, tt.wantQueued, len(queued) == 1)
		})
	}
}

// ADD calls the agent twice: allocate, whose answer carries all the pod
// needs (addresses, their gateways, the MTU), and endpoint create. It
// does not ask for the agent's config.
func TestPluginAddCallsTheAgentTwice(t *testing.T) {
	e := newPluginEnv(t, true)
	gw4, gw6 := netip.MustParseAddr("169.254.7.7"), netip.MustParseAddr("fe80::7")
	e.ag.ips = []api.IPConfig{
		{Address: netip.MustParsePrefix("10.1.0.5/32"), Family: "ipv4", Gateway: gw4, Block: netip.MustParsePrefix("10.1.0.0/26")},
		{Address: netip.MustParsePrefix("fd00::5/128"), Family: "ipv6", Gateway: gw6, Block: netip.MustParsePrefix("fd00::/120")},
	}
	e.ag.errConfig = fmt.Errorf("ADD must not ask for the config")

	require.NoError(t, e.run(t, e.p.Add, e.args("c1", e.conf(""))))
	calls := e.ag.Calls()
	require.Len(t, calls, 2, "calls: %q", calls)
	require.True(t, strings.HasPrefix(calls[0], "allocate c1/eth0 "), calls[0])
	require.True(t, strings.HasPrefix(calls[1], "endpoint c1/eth0 "), calls[1])

	var res current.Result
	require.NoError(t, json.Unmarshal(e.out.Bytes(), &res))
	require.Len(t, res.IPs, 2)
	require.Equal(t, gw4.String(), res.IPs[0].Gateway.String(), "the allocate answer's gateway")
	require.Equal(t, gw6.String(), res.IPs[1].Gateway.String())
	l, err := handle(t, e.pod).LinkByName("eth0")
	require.NoError(t, err)
	require.Equal(t, 1450, l.Attrs().MTU, "the allocate answer's MTU")
}

// An ADD whose agent goes away mid-call (restarting) waits for its
// socket, then allocates again: still two calls that do something.
func TestPluginAddWaitsForARestartingAgent(t *testing.T) {
	e := newPluginEnv(t, true)
	e.ag.allocateDown = 1
	require.NoError(t, e.run(t, e.p.Add, e.args("c1", e.conf(""))))
	calls := e.ag.Calls()
	require.Len(t, calls, 4, "calls: %q", calls)
	require.Equal(t, []string{"allocate", "wait", "allocate", "endpoint"}, []string{
		strings.Fields(calls[0])[0], calls[1], strings.Fields(calls[2])[0], strings.Fields(calls[3])[0],
	})
}

func TestPluginDel(t *testing.T) {
	tests := []struct {
		name       string
		errRelease error
		wantCode   uint
		wantQueued bool
	}{
		{name: "released"},
		{name: "nothing held", errRelease: &api.Error{Code: api.CodeNotFound, Message: "no such owner"}},
		{name: "agent down: queued, and done", errRelease: unreachable(), wantQueued: true},
		{name: "etcd down: the runtime retries", errRelease: &api.Error{Code: api.CodeTryAgain, Message: "etcd unreachable"}, wantCode: types.ErrTryAgainLater},
		{name: "agent error", errRelease: &api.Error{Code: api.CodeInternal, Message: "disk full"}, wantCode: types.ErrInternal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newPluginEnv(t, true)
			e.ag.errRelease = tt.errRelease
			a := e.args("c1", e.conf(""))
			a.Netns = "" // the pod is gone
			err := e.run(t, e.p.Funcs().Del, a)
			if tt.wantCode == 0 {
				require.NoError(t, err)
			} else {
				var te *types.Error
				require.ErrorAs(t, err, &te)
				require.Equal(t, tt.wantCode, te.Code)
			}
			queued, err := delqueue.List(e.queue)
			require.NoError(t, err)
			if tt.wantQueued {
				require.Len(t, queued, 1)
				require.Equal(t, api.Owner{ContainerID: "c1", IfName: "eth0"}, queued[0].Owner)
			} else {
				require.Empty(t, queued)
			}
		})
	}
}

func TestPluginStatus(t *testing.T) {
	tests := []struct {
		name     string
		prepare  func(f *fakeAgent)
		conf     string
		wantCode uint
		wantMsg  string
	}{
		{name: "ready", prepare: func(*fakeAgent) {}},
		{name: "agent down", prepare: func(f *fakeAgent) { f.errStatus = unreachable() }, wantCode: ErrCodeNotAvailable, wantMsg: "not available"},
		{name: "etcd down", prepare: func(f *fakeAgent) {
			f.status.Etcd = api.EtcdStatus{Reachable: false, Error: "context deadline exceeded"}
			f.status.Ready = false
		}, wantCode: ErrCodeNotAvailable, wantMsg: "cannot reach etcd: context deadline exceeded"},
		{name: "lease lost", prepare: func(f *fakeAgent) { f.status.Lease.State = "lost"; f.status.Ready = false }, wantCode: ErrCodeNotAvailable, wantMsg: "lost its etcd lease"},
		{name: "node name taken", prepare: func(f *fakeAgent) {
			f.status.Ready, f.status.Lease.State = false, "lost"
			f.status.NameTaken = &api.NameTaken{Holder: api.Incarnation{BootID: "b"}, Self: api.Incarnation{BootID: "a"}}
			f.status.Message = `node name "n1" is held by another agent`
		}, wantCode: ErrCodeNotAvailable, wantMsg: `serves no new pods: node name "n1" is held by another agent`},
		{name: "pool exhausted", prepare: func(f *fakeAgent) {
			f.status.Pools[0].Exhausted, f.status.Pools[0].Used, f.status.Pools[0].Free = true, 64, 0
		}, wantCode: ErrCodeNotAvailable, wantMsg: "pool default exhausted (ipv4) on node n1: 64 of 64"},
		{name: "another pool exhausted", conf: `,"pool":"blue"`, prepare: func(f *fakeAgent) { f.status.Pools[0].Exhausted = true }},
		{name: "exhausted family not asked for", conf: `,"families":["ipv6"]`, prepare: func(f *fakeAgent) { f.status.Pools[0].Exhausted = true }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newPluginEnv(t, false)
			tt.prepare(e.ag)
			err := e.p.Funcs().Status(e.args("", e.conf(tt.conf)))
			if tt.wantCode == 0 {
				require.NoError(t, err)
				return
			}
			var te *types.Error
			require.ErrorAs(t, err, &te)
			require.Equal(t, tt.wantCode, te.Code)
			require.Contains(t, te.Msg, tt.wantMsg)
		})
	}
}

func TestPluginGC(t *testing.T) {
	e := newPluginEnv(t, true)
	require.NoError(t, e.run(t, e.p.Add, e.args("gone", e.conf(""))))
	hostIf := HostVethName("gone", "eth0")

	// Without a list nothing is released.
	require.NoError(t, e.run(t, e.p.GC, e.args("", e.conf(""))))
	require.NotContains(t, strings.Join(e.ag.Calls(), "\n"), "gc pool")

	e.ag.gcReleased = []string{"10.1.0.5"}
	gc := e.conf(`,"cniVersion":"1.1.0","cni.dev/valid-attachments":[{"containerID":"live","ifname":"eth0"},{"containerID":"","ifname":"eth0"}]`)
	require.NoError(t, e.run(t, e.p.GC, e.args("", gc)))
	require.Equal(t, "default", e.ag.gcReq.Pool, "the agent's default pool, never every pool")
	require.Equal(t, []api.Attachment{{ContainerID: "live", IfName: "eth0"}}, e.ag.gcReq.ValidAttachments)
	_, err := handle(t, e.host).LinkByName(hostIf)
	require.Error(t, err, "the released endpoint's veth is removed")
}

func TestIPAM(t *testing.T) {
	e := newPluginEnv(t, false)
	p := &IPAM{e.p.IO}
	conf := func(extra string) []byte {
		return []byte(fmt.Sprintf(`{"cniVersion":"0.4.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","pool":"default","delQueueDir":%q}%s}`, e.queue, extra))
	}

	require.NoError(t, p.Funcs().Add(e.args("c1", conf(`,"runtimeConfig":{"ips":["10.1.0.5/26"]}`))))
	require.Equal(t, []string{`allocate c1/eth0 pool="default" permanent=true ips=[10.1.0.5] ns=default pod=web-0`}, e.ag.Calls())
	var res map[string]any
	require.NoError(t, json.Unmarshal(e.out.Bytes(), &res))
	require.Equal(t, "0.4.0", res["cniVersion"])
	require.NotContains(t, res, "interfaces")
	ips := res["ips"].([]any)
	require.Equal(t, "10.1.0.5/26", ips[0].(map[string]any)["address"])

	require.NoError(t, p.Funcs().Check(e.args("c1", conf(`,"prevResult":`+e.out.String()))))
	require.ErrorContains(t, p.Funcs().Check(e.args("c2", conf(`,"prevResult":`+e.out.String()))), "10.1.0.5 no longer held by c2/eth0",
		"another attachment's CHECK does not pass on c1's address")

	require.NoError(t, p.Funcs().Status(e.args("", conf(""))))
	e.ag.errRelease = unreachable()
	require.NoError(t, p.Funcs().Del(e.args("c1", conf(""))))
	queued, err := delqueue.List(e.queue)
	require.NoError(t, err)
	require.Len(t, queued, 1)

	e.ag.errAllocate = &api.Error{Code: api.CodeExhausted, Message: "pool default exhausted (ipv4): 1 of 1 blocks claimed"}
	var te *types.Error
	require.ErrorAs(t, p.Funcs().Add(e.args("c2", conf(""))), &te)
	require.Equal(t, ErrCodePoolExhausted, te.Code)
}

// TestDelNamesStickyIdentity: the DEL of a sticky pod names its identity
// to the agent as its ADD did (the pod's annotations and names), with
// either plugin: kvipam-ipam's agent has no endpoint that would name it,
// and neither has kvipam's for an ADD that failed before its endpoint
// (the rollback's DEL names it too). A DEL without the annotation, or
// without the pod's names, names none.
func TestDelNamesStickyIdentity(t *testing.T) {
	ann := func(a string) string {
		return `,"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{` + a + `}}`
	}
	const sticky, claim = `"kvipam.io/sticky":"10m"`, `"kvipam.io/ip-claim":"db-primary"`
	for _, tc := range []struct {
		name, ann, args, want string
	}{
		{"sticky", sticky, "", `release c1/eth0 sticky=10m0s ipClaim="" ns=default pod=web-0`},
		{"ip claim", sticky + "," + claim, "", `release c1/eth0 sticky=10m0s ipClaim="db-primary" ns=default pod=web-0`},
		{"not sticky", "", "", "release c1/eth0"},
		{"no pod names", sticky, "IgnoreUnknown=1", "release c1/eth0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newPluginEnv(t, false)
			ipam := &IPAM{e.p.IO}
			a := e.args("c1", []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","delQueueDir":%q}%s}`, e.queue, ann(tc.ann))))
			if tc.args != "" {
				a.Args = tc.args
			}
			require.NoError(t, ipam.Funcs().Del(a))
			require.Equal(t, []string{tc.want}, e.ag.Calls(), "kvipam-ipam")

			e = newPluginEnv(t, true) // kvipam deletes a veth the agent left: in a scratch host netns
			a = e.args("c1", e.conf(ann(tc.ann)))
			a.Netns = ""
			if tc.args != "" {
				a.Args = tc.args
			}
			require.NoError(t, e.run(t, e.p.Funcs().Del, a))
			require.Equal(t, []string{tc.want}, e.ag.Calls(), "kvipam")
		})
	}
}
