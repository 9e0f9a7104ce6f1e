package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// stickyPodOf is incarnation gen of the StatefulSet pod e2e/name: its
// own namespace, container ID and pod UID, the same pod name, and the
// kvipam.io/sticky annotation the runtime passes through the
// io.kubernetes.cri.pod-annotations capability.
func stickyPodOf(t *testing.T, name string, gen int, window string) *pod {
	p := newPod(t, fmt.Sprintf("%s-g%d", name, gen))
	p.rt.ContainerID = fmt.Sprintf("ctr-%s-%d", name, gen)
	p.rt.Args = [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "e2e"}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", podUID(p.name)}}
	p.rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": map[string]string{"kvipam.io/sticky": window}}
	return p
}

// TestStickyIPAcrossNodes: the pod e2e/web-0 on node 1 gets x; DEL; the
// pod re-created with a new UID and container ID on node 2 inside the
// window gets x (borrowed in node 1's block, routed to node 2 as a /32);
// a pod on node 3 reaches it; the first container's late DEL on node 1
// leaves x with the new pod.
func TestStickyIPAcrossNodes(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	r := newRouter(t)
	type member = routedNode
	join := func(name string, host int) *member {
		return joinRouted(t, c, r, name, host, "sticky=10.10.0.0/24", `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`)
	}
	m1, m2, m3 := join("st1", 11), join("st2", 12), join("st3", 13)

	first := stickyPodOf(t, "web-0", 1, "10m")
	x, _ := podAddrs(t, m1.n.mustAdd(m1.l, first))
	require.NoError(t, m1.n.del(m1.l, first))

	second := stickyPodOf(t, "web-0", 2, "10m")
	got, _ := podAddrs(t, m2.n.mustAdd(m2.l, second))
	require.Equal(t, x, got, "the re-created pod gets its address on another node")
	require.Equal(t, 1, m2.n.poolStatus("sticky", "ipv4").Borrowed, "borrowed in node 1's block")

	client := newPod(t, "st3-client")
	m3.n.mustAdd(m3.l, client)
	for _, m := range []*member{m1, m3} {
		h := nlHandle(t, m.n.host)
		waitFor(t, 15*time.Second, m.n.name+" to route "+x.String()+" to node 2", func() bool {
			return hasRoute(h, netip.PrefixFrom(x, 32), m2.addr.String())
		})
	}
	require.NoError(t, ping(client.ns, x), "a pod on node 3 reaches the re-created pod")

	// The first container's DEL comes again, late (the runtime retries):
	// nothing of the new pod's is released.
	require.NoError(t, m1.n.del(m1.l, first))
	require.NoError(t, ping(client.ns, x), "still reached after the late DEL")
	require.Equal(t, 1, m2.n.poolStatus("sticky", "ipv4").Borrowed)

	require.NoError(t, m2.n.del(m2.l, second))
	require.NoError(t, m3.n.del(m3.l, client))
}
