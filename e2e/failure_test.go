package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/cni"
)

// cniCode is the CNI error code of a libcni error.
func cniCode(t testing.TB, err error) (uint, string) {
	t.Helper()
	var te *types.Error
	require.ErrorAs(t, err, &te, "want a CNI error, got %v", err)
	return te.Code, te.Msg
}

// killingProxy stands between the plugin and the agent. It forwards every
// request, remembers the allocate answer, and on the endpoint create kills
// the agent: the agent dies between the reservation and the endpoint.
// From then on it drops every connection, as a dead agent's socket would.
type killingProxy struct {
	n      *node
	socket string
	mu     sync.Mutex
	alloc  *api.AllocateResponse
	killed bool
}

func newKillingProxy(t *testing.T, n *node) *killingProxy {
	t.Helper()
	p := &killingProxy{n: n, socket: filepath.Join(n.dir, "proxy.sock")}
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) { r.Out.URL.Scheme, r.Out.URL.Host = "http", "agent" },
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", n.socket)
		}},
		ModifyResponse: func(resp *http.Response) error {
			if resp.Request.URL.Path != api.PathAllocate || resp.StatusCode != http.StatusOK {
				return nil
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil {
				return err
			}
			resp.Body = io.NopCloser(bytes.NewReader(b))
			var ar api.AllocateResponse
			if err := json.Unmarshal(b, &ar); err != nil {
				return err
			}
			p.mu.Lock()
			p.alloc = &ar
			p.mu.Unlock()
			return nil
		},
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		if r.Method == http.MethodPost && r.URL.Path == api.PathEndpoints && !p.killed {
			n.killAgent()
			p.killed = true
		}
		killed := p.killed
		p.mu.Unlock()
		if killed {
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
			return
		}
		rp.ServeHTTP(w, r)
	})
	ln, err := net.Listen("unix", p.socket)
	require.NoError(t, err)
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return p
}

// TestAgentKilledBetweenReservationAndEndpoint: the ADD fails with "try
// again later" and leaves no veth; the reservation lapses on its lease
// after the agent is back, and its address can be allocated again.
func TestAgentKilledBetweenReservationAndEndpoint(t *testing.T) {
	n := newNode(t, "node-k")
	// The agent drains another queue than the plugins', so what frees the
	// address is the reservation's lease, not the plugin's queued release.
	n.startAgent(agentOpts{pools: []string{dualStackPool}, reservationTTL: 3 * time.Second, queue: filepath.Join(n.dir, "agent-queue")})
	proxy := newKillingProxy(t, n)
	viaProxy := n.kvipamList("killed", "1.1.0", fmt.Sprintf(`,"agentSocket":%q`, proxy.socket))
	a := newPod(t, "a")

	_, err := n.add(viaProxy, a)
	code, msg := cniCode(t, err)
	require.Equal(t, types.ErrTryAgainLater, code, msg)
	require.Contains(t, msg, "create endpoint")
	require.NotNil(t, proxy.alloc, "the reservation was made")
	require.Equal(t, "reserved", proxy.alloc.State)
	_, err = nlHandle(t, n.host).LinkByName(cni.HostVethName(a.rt.ContainerID, "eth0"))
	require.Error(t, err, "the rollback removed the veth")
	queued, err := delqueue.List(n.queue)
	require.NoError(t, err)
	require.Len(t, queued, 1, "the rollback queued the release it could not make")

	n.startAgent(n.agentArgs)
	require.NotEmpty(t, n.ipKeys(a.rt.ContainerID), "the reservation outlived the agent")
	waitFor(t, 30*time.Second, "the reservation's lease to expire", func() bool { return len(n.ipKeys(a.rt.ContainerID)) == 0 })

	// The address is free: another pod can have it.
	ip := proxy.alloc.IPs[0].Address.Addr()
	b := newPod(t, "b")
	b.rt.CapabilityArgs = map[string]any{"ips": []string{ip.String()}}
	withIPs := n.kvipamList("pods", "1.1.0", `,"capabilities":{"ips":true}`)
	rb := n.mustAdd(withIPs, b)
	b4, _ := podAddrs(t, rb)
	require.Equal(t, ip, b4)
	require.NoError(t, ping(b.ns, hostAddrV4))
	require.NoError(t, n.del(withIPs, b))
}

// TestDelWithAgentDownIsQueued: DEL succeeds while the agent is down; the
// agent applies it when it starts, so the IPs do not leak.
func TestDelWithAgentDownIsQueued(t *testing.T) {
	n := newNode(t, "node-q")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("pods", "1.1.0", "")
	a, b := newPod(t, "a"), newPod(t, "b")
	n.mustAdd(l, a)
	n.mustAdd(l, b)

	n.stopAgent()
	require.NoError(t, n.del(l, a), "DEL with the agent down succeeds")
	_, err := nlHandle(t, n.host).LinkByName(cni.HostVethName(a.rt.ContainerID, "eth0"))
	require.Error(t, err, "and removes the veth at once")
	queued, err := delqueue.List(n.queue)
	require.NoError(t, err)
	require.Len(t, queued, 1)
	require.Equal(t, a.rt.ContainerID, queued[0].Owner.ContainerID)

	n.startAgent(n.agentArgs)
	require.Empty(t, n.ipKeys(a.rt.ContainerID), "the agent applied the queued DEL before serving")
	require.Len(t, n.ipKeys(b.rt.ContainerID), 2, "and nothing else")
	queued, err = delqueue.List(n.queue)
	require.NoError(t, err)
	require.Empty(t, queued)
	require.NoError(t, n.check(l, b))
	require.NoError(t, n.del(l, b))
}

// TestStatusAndAgentDown: STATUS is ready, then unavailable (50) when the
// pool is exhausted, ready again after a DEL, and unavailable when the
// agent is down; an ADD with the agent down fails at once with 11, naming
// the socket (agentTimeout is a minute: the ADD returning at all shows it
// did not wait).
func TestStatusAndAgentDown(t *testing.T) {
	n := newNode(t, "node-s")
	// A /30 with /30 blocks: one block of two usable addresses.
	n.startAgent(agentOpts{pools: []string{"tiny=10.9.0.0/30"}, blockV4: 30})
	l := n.kvipamList("tiny", "1.1.0", `,"pool":"tiny","agentTimeout":"1m"`)
	require.NoError(t, n.statusOf(l))

	a, b, c := newPod(t, "a"), newPod(t, "b"), newPod(t, "c")
	n.mustAdd(l, a)
	n.mustAdd(l, b)
	_, err := n.add(l, c)
	code, msg := cniCode(t, err)
	require.Equal(t, cni.ErrCodePoolExhausted, code, msg)
	require.Contains(t, msg, "pool tiny exhausted")
	_, err = nlHandle(t, c.ns).LinkByName("eth0")
	require.Error(t, err, "nothing is left of the failed ADD")

	code, msg = cniCode(t, n.statusOf(l))
	require.Equal(t, uint(types.ErrPluginNotAvailable), code, msg)
	require.Contains(t, msg, "pool tiny exhausted")

	require.NoError(t, n.del(l, a))
	require.NoError(t, n.statusOf(l), "a free address again")

	n.stopAgent()
	code, msg = cniCode(t, n.statusOf(l))
	require.Equal(t, uint(types.ErrPluginNotAvailable), code, msg)
	require.Contains(t, msg, "not available")

	_, err = n.add(l, c)
	code, msg = cniCode(t, err)
	require.Equal(t, types.ErrTryAgainLater, code, msg)
	require.Contains(t, msg, n.socket)
	require.Contains(t, msg, "no kvipam agent listens there")
	require.NotContains(t, msg, "not ready after", "it did not wait for the agent")
	require.False(t, errors.Is(err, context.DeadlineExceeded))
}

// TestAddDuringAgentRestart: an ADD that finds no agent (it is
// restarting) fails at once with 11, naming the socket, and leaves
// nothing behind; the runtime's retry succeeds once the agent is back,
// and the first pod kept its endpoint through the restart. (An ADD whose
// connection breaks mid-call waits for the agent instead:
// cni/TestPluginAddWaitsForARestartingAgent.)
func TestAddDuringAgentRestart(t *testing.T) {
	n := newNode(t, "node-r")
	n.startAgent(agentOpts{pools: []string{dualStackPool}})
	l := n.kvipamList("pods", "1.1.0", `,"agentTimeout":"60s"`)
	a, b := newPod(t, "a"), newPod(t, "b")
	n.mustAdd(l, a)

	n.stopAgent()
	_, err := n.add(l, b)
	code, msg := cniCode(t, err)
	require.Equal(t, types.ErrTryAgainLater, code, msg)
	require.Contains(t, msg, n.socket)
	_, err = nlHandle(t, n.host).LinkByName(cni.HostVethName(b.rt.ContainerID, "eth0"))
	require.Error(t, err, "the failed ADD removed its veth")

	n.startAgent(n.agentArgs)
	res, err := n.add(l, b) // the runtime's retry
	require.NoError(t, err)
	v4, v6 := podAddrs(t, res)
	require.True(t, v4.IsValid() && v6.IsValid(), "a dual-stack result: %v", res)
	require.Len(t, n.ipKeys(b.rt.ContainerID), 2, "both addresses are held")
	require.NoError(t, ping(b.ns, hostAddrV4))
	require.NoError(t, n.check(l, a), "the first pod kept its endpoint through the restart")
	require.NoError(t, n.del(l, a))
	require.NoError(t, n.del(l, b))
}

// TestPodVethVanishesWithoutDel: the pod's veth disappears without a DEL
// (as when its netns is deleted): the agent's reconciler notices, and
// after the grace period and a re-check releases the pod's addresses and
// endpoint (in bpf mode, its program too).
func TestPodVethVanishesWithoutDel(t *testing.T) {
	n := newNode(t, "vanish")
	n.startAgent(agentOpts{pools: []string{dualStackPool}, gcInterval: 300 * time.Millisecond})
	l := n.kvipamList("kv", "1.0.0", "")
	gone, kept := newPod(t, "gone"), newPod(t, "kept")
	n.mustAdd(l, gone)
	n.mustAdd(l, kept)
	require.Equal(t, 2, n.poolStatus("default", "ipv4").Used)

	h := nlHandle(t, gone.ns)
	eth0, err := h.LinkByName("eth0")
	require.NoError(t, err)
	require.NoError(t, h.LinkDel(eth0)) // takes the host veth with it

	waitFor(t, 20*time.Second, "the vanished pod's endpoint to be collected", func() bool {
		eps, err := n.client().Endpoints(context.Background())
		return err == nil && len(eps) == 1 && eps[0].Owner.ContainerID == kept.rt.ContainerID
	})
	require.Equal(t, 1, n.poolStatus("default", "ipv4").Used, "its addresses are back in the pool")
	require.Equal(t, 1, n.poolStatus("default", "ipv6").Used)
	require.NoError(t, ping(kept.ns, hostAddrV4), "the other pod is untouched")
	require.NoError(t, n.del(l, gone), "a late DEL still succeeds")
}
