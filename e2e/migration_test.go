package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/guestannounce"
)

// Live migration of a VM between nodes, as KubeVirt runs one: the VM's
// launcher pod on the source node, a second launcher pod (the target,
// marked kubevirt.io/migrationJobName) on the target node while the guest
// still runs on the source, the cut-over when the guest runs on the
// target, the source pod's DEL. Both pods carry the VM's sticky identity
// (kvipam.io/ip-claim, kvipam.io/sticky, from the VM's template).

// migrationPool is the pool of the migration tests' nodes.
const migrationPool = "vms"

// vmPod is launcher pod name of VM e2e/vm1; migration, if set, marks it
// the target of that migration.
func vmPod(t testing.TB, name, migration string) *pod {
	p := newPod(t, name)
	ann := map[string]string{"kvipam.io/sticky": "10m", "kvipam.io/ip-claim": "vm1"}
	if migration != "" {
		ann["kubevirt.io/migrationJobName"] = migration
	}
	p.rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": ann}
	return p
}

// migrationRig is three routed nodes (host-gw through a router), the VM's
// source pod on the first, a client pod on the third.
type migrationRig struct {
	t                  *testing.T
	c                  *cluster.Cluster
	src, dst, far      *routedNode
	source, client     *pod
	x                  netip.Addr
	ctl                func(args ...string) ([]byte, error)
	targetAdmittedFrom *pod
}

func startMigrationRig(t *testing.T) *migrationRig {
	c := cluster.Start(t, cluster.Options{})
	r := newRouter(t)
	join := func(name string, host int) *routedNode {
		return joinRouted(t, c, r, name, host, migrationPool+"=10.11.0.0/24", `,"capabilities":{"io.kubernetes.cri.pod-annotations":true}`)
	}
	m := &migrationRig{t: t, c: c, src: join("mg1", 21), dst: join("mg2", 22), far: join("mg3", 23)}
	m.ctl = m.src.n.clusterCtl(c)
	m.source = vmPod(t, "virt-launcher-vm1-src", "")
	m.x, _ = podAddrs(t, m.src.n.mustAdd(m.src.l, m.source))
	m.client = newPod(t, "mg3-client")
	m.far.n.mustAdd(m.far.l, m.client)
	m.answeredBy(m.source)
	return m
}

// admit adds the migration's target pod on the target node: it gets the
// VM's address.
func (m *migrationRig) admit(name string) *pod {
	m.t.Helper()
	target := vmPod(m.t, name, "kubevirt-migrate-vm1")
	got, _ := podAddrs(m.t, m.dst.n.mustAdd(m.dst.l, target))
	require.Equal(m.t, m.x, got, "the migration's target gets the VM's address")
	return target
}

// binding is the VM's sticky binding as kvipamctl claim show prints it.
func (m *migrationRig) binding() records.Binding {
	m.t.Helper()
	out, err := m.ctl("claim", "show", "e2e/vm1", "--pool", migrationPool, "-o", "json")
	require.NoError(m.t, err, "%s", out)
	var rows []records.Binding
	require.NoError(m.t, json.Unmarshal(out, &rows), "%s", out)
	require.Len(m.t, rows, 1)
	return rows[0]
}

// record is x's address record as kvipamctl ip show prints it.
func (m *migrationRig) record() records.Record {
	m.t.Helper()
	out, err := m.ctl("ip", "show", m.x.String(), "-o", "json")
	require.NoError(m.t, err, "%s", out)
	var r records.Record
	require.NoError(m.t, json.Unmarshal(out, &r), "%s", out)
	return r
}

// owners checks that the binding and x's record name owner on node as
// the forwarding owner, and alt (nil: none) as the second.
func (m *migrationRig) owners(owner *pod, node *routedNode, alt *pod) {
	m.t.Helper()
	b, rec := m.binding(), m.record()
	require.Equal(m.t, owner.rt.ContainerID, b.Owner.ContainerID, "the binding's owner")
	require.Equal(m.t, owner.rt.ContainerID, rec.ContainerID, "the record's owner")
	require.Equal(m.t, node.n.name, b.Node)
	require.Equal(m.t, node.n.name, rec.Node)
	if alt == nil {
		require.Nil(m.t, b.Alternate, "no second owner in the binding")
		require.Nil(m.t, rec.Alternate, "no second owner in the record")
		return
	}
	require.NotNil(m.t, b.Alternate, "the binding names the second owner")
	require.NotNil(m.t, rec.Alternate, "the record names the second owner")
	require.Equal(m.t, alt.rt.ContainerID, b.Alternate.Owner.ContainerID)
	require.Equal(m.t, alt.rt.ContainerID, rec.Alternate.Owner.ContainerID)
}

// answeredBy waits until the client's pings of x are answered by p's
// network namespace (its echo counter moves), and no other pod's.
func (m *migrationRig) answeredBy(p *pod, others ...*pod) {
	m.t.Helper()
	waitFor(m.t, 20*time.Second, p.name+" to answer the client's pings of "+m.x.String(), func() bool {
		before := make([]int, len(others))
		for i, o := range others {
			before[i] = inEchos(m.t, o)
		}
		at := inEchos(m.t, p)
		if ping(m.client.ns, m.x) != nil || inEchos(m.t, p) == at {
			return false
		}
		for i, o := range others {
			if inEchos(m.t, o) != before[i] {
				return false
			}
		}
		return true
	})
}

// inEchos counts the ICMP echo requests p's network namespace received
// (Icmp InEchos of its /proc/net/snmp).
func inEchos(t testing.TB, p *pod) int {
	t.Helper()
	var n int
	require.NoError(t, p.ns.Do(func(ns.NetNS) error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var head []string
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Icmp:" {
				continue
			}
			if head == nil {
				head = f
				continue
			}
			for i, h := range head {
				if h == "InEchos" {
					n, err = strconv.Atoi(f[i])
					return err
				}
			}
		}
		return fmt.Errorf("no Icmp InEchos in %s's snmp", p.name)
	}))
	return n
}

// TestMigrationTargetAdmittedAsSecondOwner: the target's ADD, while the
// source runs, gets the VM's address as its second, non-forwarding owner
// (in the binding, in the address's record, for kvipamctl); the target's
// node routes nothing to it, and the client's pings still reach the
// source.
func TestMigrationTargetAdmittedAsSecondOwner(t *testing.T) {
	m := startMigrationRig(t)
	target := m.admit("virt-launcher-vm1-dst")
	m.owners(m.source, m.src, target)
	b := m.binding()
	require.Equal(t, m.dst.n.name, b.Alternate.Node)
	require.Equal(t, "kubevirt-migrate-vm1", b.Alternate.Migration)
	require.False(t, hostRouteTo(t, m.dst.n, m.x), "the target's node routes nothing to the target before the cut-over")
	require.True(t, hostRouteTo(t, m.src.n, m.x), "the source's node routes the address to the source")
	out, err := m.ctl("ip", "list", "--pool", migrationPool)
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "e2e/virt-launcher-vm1-dst", "ip list shows the second owner")
	out, err = m.ctl("check")
	require.NoError(t, err, "kvipamctl check is clean during a migration: %s", out)
	m.answeredBy(m.source, target)

	// A retried ADD of the target gets the same, and writes nothing new.
	rev := m.binding()
	got, _ := podAddrs(t, m.dst.n.mustAdd(m.dst.l, target))
	require.Equal(t, m.x, got)
	require.Equal(t, rev, m.binding(), "a retried admission writes nothing")
}

// TestMigrationThirdPodRefused: while a migration is in progress, a third
// pod of the identity is refused, marked as a migration's target or not.
func TestMigrationThirdPodRefused(t *testing.T) {
	m := startMigrationRig(t)
	target := m.admit("virt-launcher-vm1-dst")
	third := vmPod(t, "virt-launcher-vm1-third", "kubevirt-migrate-vm1-again")
	_, err := m.far.n.add(m.far.l, third)
	require.Error(t, err, "a third pod of the identity")
	require.Contains(t, err.Error(), "a third pod cannot join")
	plain := vmPod(t, "virt-launcher-vm1-plain", "")
	_, err = m.far.n.add(m.far.l, plain)
	require.Error(t, err, "a second pod without the marker")
	require.Contains(t, err.Error(), "two live pods cannot share one identity")
	m.owners(m.source, m.src, target)
	m.answeredBy(m.source, target)
}

// cutOver cuts the migration over as an operator does.
func (m *migrationRig) cutOver() {
	m.t.Helper()
	out, err := m.ctl("ip", "migrate", "e2e/vm1", "--pool", migrationPool, "--cut-over")
	require.NoError(m.t, err, "%s", out)
}

// history is x's IP history, oldest first, as kvipamctl prints it.
func (m *migrationRig) history() []historyRow {
	m.t.Helper()
	out, err := m.ctl("ip", "history", m.x.String(), "-o", "json")
	require.NoError(m.t, err, "%s", out)
	var rows []historyRow
	require.NoError(m.t, json.Unmarshal(out, &rows), "%s", out)
	return rows
}

type historyRow struct {
	ContainerID string `json:"containerID"`
	Node        string `json:"node"`
	Reason      string `json:"reason"`
}

// hasHistory reports whether x's history has an interval of p ended for
// reason.
func (m *migrationRig) hasHistory(p *pod, reason string) bool {
	rows := m.history()
	for _, r := range rows {
		if r.ContainerID == p.rt.ContainerID && r.Reason == reason {
			return true
		}
	}
	m.t.Logf("no interval of %s ended by %s in %+v", p.rt.ContainerID, reason, rows)
	return false
}

// TestMigrationFailedBeforeCutOverKeepsSource: the target's DEL before
// the cut-over (KubeVirt deletes the target pod of a failed or cancelled
// migration) drops only the second owner; the source forwards on, and
// the client's pings every 10 ms lose nothing throughout.
func TestMigrationFailedBeforeCutOverKeepsSource(t *testing.T) {
	m := startMigrationRig(t)
	pings := startPinger(t, m.client.ns, m.x, 10*time.Millisecond)
	target := m.admit("virt-launcher-vm1-dst")
	m.owners(m.source, m.src, target)
	require.NoError(t, m.dst.n.del(m.dst.l, target))
	m.owners(m.source, m.src, nil)
	require.True(t, m.hasHistory(target, "alternate-ended"), "IP history: the second owner's interval")
	require.NoError(t, m.dst.n.del(m.dst.l, target), "a DEL retried")
	m.owners(m.source, m.src, nil)
	m.answeredBy(m.source)
	require.True(t, hostRouteTo(t, m.src.n, m.x))
	finish(pings)
	runs, sent := pings.losses()
	require.Empty(t, runs, "no ping lost of %d while the migration failed", sent)
}

// TestMigrationSourceDelAfterCutOver: after the cut-over the target
// forwards; the source pod's DEL (and a late one) removes nothing of the
// target's, and the addresses stay the identity's after the target's DEL.
func TestMigrationSourceDelAfterCutOver(t *testing.T) {
	m := startMigrationRig(t)
	target := m.admit("virt-launcher-vm1-dst")
	m.cutOver()
	m.owners(target, m.dst, m.source)
	require.True(t, m.hasHistory(m.source, "migrated"), "IP history: the source's interval ended at the cut-over")
	waitFor(t, 20*time.Second, "the target's node to route the address to the target", func() bool { return hostRouteTo(t, m.dst.n, m.x) })
	m.answeredBy(target, m.source)

	pings := startPinger(t, m.client.ns, m.x, 10*time.Millisecond)
	require.NoError(t, m.src.n.del(m.src.l, m.source))
	m.owners(target, m.dst, nil)
	require.True(t, m.hasHistory(m.source, "alternate-ended"))
	require.NoError(t, m.src.n.del(m.src.l, m.source), "a late DEL of the source")
	m.owners(target, m.dst, nil)
	m.answeredBy(target)
	finish(pings)
	runs, sent := pings.losses()
	require.Empty(t, runs, "no ping lost of %d while the source went", sent)

	require.NoError(t, m.dst.n.del(m.dst.l, target))
	b := m.binding()
	require.True(t, b.Kept(), "kept for the identity after the target's DEL")
	require.Equal(t, []netip.Addr{m.x}, b.Addrs)
}

// TestMigrationSourceDelBeforeCutOverHandsOver: the source pod's DEL
// before any cut-over (the guest never announced itself, or the VM left
// the source) hands the addresses to the target, which forwards.
func TestMigrationSourceDelBeforeCutOverHandsOver(t *testing.T) {
	m := startMigrationRig(t)
	target := m.admit("virt-launcher-vm1-dst")
	require.NoError(t, m.src.n.del(m.src.l, m.source))
	m.owners(target, m.dst, nil)
	waitFor(t, 20*time.Second, "the target's node to route the address to the target", func() bool { return hostRouteTo(t, m.dst.n, m.x) })
	m.answeredBy(target)
}

// TestMigrationAgentKilledAtEachStep kills an agent at each step of a
// migration and checks, once it is back, one forwarding owner, the
// routes, and the pod the guest runs on answering.
func TestMigrationAgentKilledAtEachStep(t *testing.T) {
	m := startMigrationRig(t)

	// The source's agent dead while the target is admitted: admission
	// needs etcd, not the source's agent.
	m.src.n.killAgent()
	target := m.admit("virt-launcher-vm1-dst")
	m.src.n.startAgent(m.src.n.agentArgs)
	m.owners(m.source, m.src, target)
	m.answeredBy(m.source, target)

	// The target's agent killed between admission and cut-over: its
	// endpoint comes back as the second owner, routed nowhere.
	m.dst.n.killAgent()
	m.dst.n.startAgent(m.dst.n.agentArgs)
	m.owners(m.source, m.src, target)
	require.False(t, hostRouteTo(t, m.dst.n, m.x))
	m.answeredBy(m.source, target)

	// The cut-over while the target's agent is down (as if it died in
	// the middle of it): back, it routes to its pod.
	m.dst.n.killAgent()
	m.cutOver()
	m.dst.n.startAgent(m.dst.n.agentArgs)
	m.owners(target, m.dst, m.source)
	waitFor(t, 20*time.Second, "the restarted target agent to route to its pod", func() bool { return hostRouteTo(t, m.dst.n, m.x) })
	m.answeredBy(target, m.source)

	// Cut back to the source while the source's agent is down: the
	// source's agent learns it at start, the target's agent at once.
	target2 := m.source
	m.src.n.killAgent()
	m.cutOver()
	m.src.n.startAgent(m.src.n.agentArgs)
	m.owners(target2, m.src, target)
	waitFor(t, 20*time.Second, "the target's node to take its host route away", func() bool { return !hostRouteTo(t, m.dst.n, m.x) || routedVia(t, m.dst.n, m.x, m.src.addr) })
	m.answeredBy(target2, target)

	// After the cut-over, the agent of the pod that left forwarding is
	// killed before it saw it: it comes back knowing.
	m.dst.n.killAgent()
	m.cutOver()
	m.src.n.killAgent()
	m.src.n.startAgent(m.src.n.agentArgs)
	m.dst.n.startAgent(m.dst.n.agentArgs)
	m.owners(target, m.dst, m.source)
	m.answeredBy(target, m.source)

	// The pods go; nothing is left but the identity's kept addresses.
	require.NoError(t, m.src.n.del(m.src.l, m.source))
	require.NoError(t, m.dst.n.del(m.dst.l, target))
	require.True(t, m.binding().Kept())
	out, err := m.ctl("check")
	require.NoError(t, err, "kvipamctl check: %s", out)
}

// routedVia reports whether n routes ip/32 through gateway via.
func routedVia(t *testing.T, n *node, ip, via netip.Addr) bool {
	return hasRoute(nlHandle(t, n.host), netip.PrefixFrom(ip, ip.BitLen()), via.String())
}

// TestMigrationCutOverOnGuestAnnouncement: the guest, now running in the
// target pod, announces itself (a gratuitous ARP, or QEMU's RARP); the
// target's agent sees it on the target's host veth and cuts over: the
// target forwards, its node routes to it, the other nodes route to its
// node, and the client's pings are answered by the target. A second
// announcement changes nothing.
func TestMigrationCutOverOnGuestAnnouncement(t *testing.T) {
	for _, kind := range []announce.Kind{announce.GratuitousARP, announce.RARP} {
		t.Run(string(kind), func(t *testing.T) {
			m := startMigrationRig(t)
			target := m.admit("virt-launcher-vm1-dst")
			m.answeredBy(m.source, target)
			require.NoError(t, guestannounce.Send(target.ns.Path(), "eth0", kind, m.x, nil))
			waitFor(t, 20*time.Second, "the cut-over on the guest's "+string(kind), func() bool {
				b := m.binding()
				return b.Owner.ContainerID == target.rt.ContainerID
			})
			m.owners(target, m.dst, m.source)
			waitFor(t, 20*time.Second, "the target's node to route to the target", func() bool { return hostRouteTo(t, m.dst.n, m.x) })
			waitFor(t, 20*time.Second, "the far node to route to the target's node", func() bool { return routedVia(t, m.far.n, m.x, m.dst.addr) })
			waitFor(t, 20*time.Second, "the source's node to route to the target's node", func() bool { return routedVia(t, m.src.n, m.x, m.dst.addr) })
			m.answeredBy(target, m.source)
			rev := m.binding().Rev
			require.NoError(t, guestannounce.Send(target.ns.Path(), "eth0", kind, m.x, nil))
			m.answeredBy(target, m.source)
			require.Equal(t, rev, m.binding().Rev, "a second announcement writes nothing")
		})
	}
}
