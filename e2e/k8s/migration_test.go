package k8s

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A KubeVirt live migration, played by two launcher-like pods: the VM's
// template puts kvipam.io/sticky and kvipam.io/ip-claim on every launcher
// pod; KubeVirt marks the target's with kubevirt.io/migrationJobName, and
// nothing on the source's. The guest is the pods' own network namespace:
// the source's answers until the guest pauses there, the target's from
// its resume, when it announces itself with a gratuitous ARP.

const (
	migrationNS  = "k8s-migrate"
	migrationVM  = "vm1"
	migrationJob = "kubevirt-migrate-vm1"
	// pingEvery is the client's ping interval, as the issue measures.
	pingEvery = 10 * time.Millisecond
)

// launcherAnnotations are a launcher pod's: the VM's identity, and for
// the migration's target KubeVirt's marker.
func launcherAnnotations(migration string) map[string]string {
	a := map[string]string{"kvipam.io/sticky": "10m", "kvipam.io/ip-claim": migrationVM}
	if migration != "" {
		a["kubevirt.io/migrationJobName"] = migration
	}
	return a
}

// bindingView is a sticky identity as kvipamctl claim show -o json prints
// it: the members this test reads.
type bindingView struct {
	Identity string    `json:"identity"`
	Addrs    []string  `json:"addrs"`
	Owner    ownerView `json:"owner"`
	Node     string    `json:"node"`
	Holder   string    `json:"holder"`
	KeptFor  string    `json:"keptFor"`
	Alt      *struct {
		Owner     ownerView `json:"owner"`
		Node      string    `json:"node"`
		Migration string    `json:"migration"`
	} `json:"alternate"`
}

type ownerView struct {
	ContainerID string `json:"containerID"`
	Namespace   string `json:"namespace"`
	Pod         string `json:"pod"`
	PodUID      string `json:"podUID"`
}

func (c *kcluster) vmBinding(tb testing.TB) bindingView {
	tb.Helper()
	out, err := c.kvipamctl("-o", "json", "claim", "show", migrationNS+"/"+migrationVM, "--pool", "default")
	require.NoError(tb, err)
	var rows []bindingView
	require.NoError(tb, json.Unmarshal([]byte(out), &rows), "%s", out)
	require.Len(tb, rows, 1, "%s", out)
	return rows[0]
}

// logClaim logs kvipamctl claim show of the VM's identity.
func (c *kcluster) logClaim(tb testing.TB, when string) {
	tb.Helper()
	out, err := c.kvipamctl("claim", "show", migrationNS+"/"+migrationVM, "--pool", "default")
	require.NoError(tb, err)
	tb.Logf("%s: kvipamctl claim show %s/%s:\n%s", when, migrationNS, migrationVM, strings.TrimSpace(out))
}

// requireOwners checks that the VM's binding names owner on its node as
// the pod its addresses route to, and alt (nil: none) as the second,
// non-forwarding owner; and that kvipamctl ip show says the same of each
// address.
func (c *kcluster) requireOwners(tb testing.TB, owner, alt *pod) {
	tb.Helper()
	b := c.vmBinding(tb)
	require.Equal(tb, owner.Metadata.UID, b.Owner.PodUID, "the binding's owner is %s: %+v", owner.Metadata.Name, b)
	require.Equal(tb, owner.Spec.NodeName, b.Node)
	if alt == nil {
		require.Nil(tb, b.Alt, "no second owner: %+v", b)
	} else {
		require.NotNil(tb, b.Alt, "the binding names %s the second owner: %+v", alt.Metadata.Name, b)
		require.Equal(tb, alt.Metadata.UID, b.Alt.Owner.PodUID, "the second owner is %s", alt.Metadata.Name)
		require.Equal(tb, alt.Spec.NodeName, b.Alt.Node)
		require.Equal(tb, migrationJob, b.Alt.Migration, "the migration's name, from kubevirt.io/migrationJobName")
	}
	for _, ip := range owner.ips() {
		out, err := c.kvipamctl("-o", "json", "ip", "show", ip)
		require.NoError(tb, err)
		var r struct {
			PodUID    string `json:"podUID"`
			Node      string `json:"node"`
			Alternate *struct {
				Owner ownerView `json:"owner"`
			} `json:"alternate"`
		}
		require.NoError(tb, json.Unmarshal([]byte(out), &r), "%s", out)
		require.Equal(tb, owner.Metadata.UID, r.PodUID, "ip show %s: the owner: %s", ip, out)
		require.Equal(tb, owner.Spec.NodeName, r.Node, "ip show %s: the node", ip)
		if alt == nil {
			require.Nil(tb, r.Alternate, "ip show %s: no second owner: %s", ip, out)
		} else {
			require.NotNil(tb, r.Alternate, "ip show %s: the second owner: %s", ip, out)
			require.Equal(tb, alt.Metadata.UID, r.Alternate.Owner.PodUID, "ip show %s", ip)
		}
	}
}

// awaitAnsweredBy waits until the echoes of the pod namespace at want
// move in both families while those of other ("": none) do not: the
// client's pings reach want's pod, and only it.
func awaitAnsweredBy(tb testing.TB, what, want, other string) {
	tb.Helper()
	require.NoError(tb, waitFor(2*time.Minute, what, func() error {
		echoes := func(path string) (int, int, error) {
			if path == "" {
				return 0, 0, nil
			}
			return inEchos(path)
		}
		w4, w6, err := echoes(want)
		if err != nil {
			return err
		}
		o4, o6, err := echoes(other)
		if err != nil {
			return err
		}
		time.Sleep(20 * pingEvery)
		w4b, w6b, err := echoes(want)
		if err != nil {
			return err
		}
		o4b, o6b, err := echoes(other)
		if err != nil {
			return err
		}
		if w4b == w4 || w6b == w6 || o4b != o4 || o6b != o6 {
			return fmt.Errorf("echoes received: the expected pod +%d/+%d (IPv4/IPv6), the other +%d/+%d", w4b-w4, w6b-w6, o4b-o4, o6b-o6)
		}
		return nil
	}))
}

// TestK8sLiveMigration: a VM's live migration between the two kubelets,
// as KubeVirt runs one. The source launcher pod on n1 holds the VM's
// sticky identity; the target launcher pod on n2 (kubevirt.io/
// migrationJobName) gets the same addresses as its second owner while the
// source forwards; a client pod on n1 (the suite has two nodes: the
// source's) pings the VM's IPv4 and IPv6 addresses every 10 ms; the guest
// pauses on the source (its namespace stops answering) and announces
// itself from the target's namespace (a gratuitous ARP, as QEMU repeats
// its announcement: five rounds), the trigger of the cut-over; the pings
// resume from the target, the source pod is deleted, then the target:
// the addresses stay kept for the identity, and kvipamctl check is
// clean. The figures (lost pings, time from the trigger to the first
// answer) are logged; what is asserted holds under load: the addresses
// and owners, that the pings resume from the target, and that no echo is
// refused (ICMP destination unreachable) or loops between the two nodes
// (time exceeded).
func TestK8sLiveMigration(t *testing.T) {
	c := cluster(t)
	c.install(t)
	t.Cleanup(func() {
		c.deleteNamespace(t, migrationNS)
		_, _ = c.kvipamctl("claim", "release", migrationNS+"/"+migrationVM, "--pool", "default")
	})
	client := c.runPod(t, migrationNS, "client", "n1", nil)
	source := c.runPod(t, migrationNS, "virt-launcher-vm1-src", "n1", launcherAnnotations(""))
	v4, v6 := requireIPsIn(t, source, "default")
	c.requireOwners(t, &source, nil)
	clientNS, err := c.podNetns(client)
	require.NoError(t, err)
	sourceNS, err := c.podNetns(source)
	require.NoError(t, err)

	pingers := map[string]*fastPinger{}
	for _, a := range []netip.Addr{v4, v6} {
		p, err := startFastPinger(clientNS, a, pingEvery)
		require.NoError(t, err)
		t.Cleanup(func() { p.Close(0) })
		pingers[a.String()] = p
	}
	t0 := time.Now()
	for a, p := range pingers {
		require.NoError(t, waitFor(2*time.Minute, "the client's pings of "+a+" answered", func() error {
			if _, ok := p.firstReplySince(t0); !ok {
				return fmt.Errorf("no reply yet")
			}
			return nil
		}))
	}
	steady := time.Now()

	// The migration's target: KubeVirt's marker, the same identity; its
	// ADD is not refused, and it gets the VM's addresses.
	target := c.runPod(t, migrationNS, "virt-launcher-vm1-dst", "n2", launcherAnnotations(migrationJob))
	require.ElementsMatch(t, source.ips(), target.ips(), "the target's podIPs are the VM's")
	c.requireOwners(t, &source, &target)
	c.logClaim(t, "the target admitted")
	targetNS, err := c.podNetns(target)
	require.NoError(t, err)
	awaitAnsweredBy(t, "the client's pings reach the source only, before the cut-over", sourceNS, targetNS)
	admitted := time.Now()

	// The cut-over: the guest pauses on the source and resumes on the
	// target, which announces it.
	g, err := newGARPSender(targetNS, "eth0", v4)
	require.NoError(t, err)
	if err := stopAnswering(sourceNS); err != nil {
		_ = g.Close()
		t.Fatal(err)
	}
	trigger := time.Now()
	if err := g.send(); err != nil {
		_ = g.Close()
		t.Fatal(err)
	}
	// QEMU's announce_self repeats it: five rounds, 50 ms apart, then
	// 100 ms more each time.
	go func() {
		defer g.Close()
		for _, d := range []time.Duration{50, 150, 250, 350} {
			time.Sleep(d * time.Millisecond)
			_ = g.send()
		}
	}()
	answered := map[string]time.Time{}
	for a, p := range pingers {
		require.NoError(t, waitFor(2*time.Minute, "the client's pings of "+a+" answered by the target", func() error {
			at, ok := p.firstReplySince(trigger)
			if !ok {
				return fmt.Errorf("no reply since the trigger")
			}
			answered[a] = at
			return nil
		}))
	}
	require.NoError(t, waitFor(2*time.Minute, "the binding names the target its owner", func() error {
		if b := c.vmBinding(t); b.Owner.PodUID != target.Metadata.UID {
			return fmt.Errorf("owner %s/%s", b.Owner.Namespace, b.Owner.Pod)
		}
		return nil
	}))
	c.requireOwners(t, &target, &source)
	c.logClaim(t, "after the cut-over")
	awaitAnsweredBy(t, "the client's pings reach the target only, after the cut-over", targetNS, sourceNS)

	// The source's DEL after the cut-over takes nothing of the target's.
	c.deletePod(t, migrationNS, source.Metadata.Name)
	require.NoError(t, waitFor(3*time.Minute, "the source's DEL drops it from the binding", func() error {
		if b := c.vmBinding(t); b.Alt != nil {
			return fmt.Errorf("second owner %s/%s", b.Alt.Owner.Namespace, b.Alt.Owner.Pod)
		}
		return nil
	}))
	c.requireOwners(t, &target, nil)
	c.requireRecords(t, target)
	awaitAnsweredBy(t, "the client's pings reach the target after the source's deletion", targetNS, "")
	end := time.Now()
	for _, p := range pingers {
		p.Close(time.Second)
	}

	// The figures. Lost: no reply. Unreachable: an ICMP destination
	// unreachable came back (no route somewhere: refused). Looped: an
	// ICMP time exceeded came back (the two nodes routed the address to
	// each other for a moment).
	t.Logf("trigger: the guest's gratuitous ARP for %s from the target's namespace", v4)
	for _, a := range []string{v4.String(), v6.String()} {
		p := pingers[a]
		before, during, after := p.figures(steady, trigger), p.figures(trigger, answered[a]), p.figures(trigger, end)
		t.Logf("%s: before the trigger (the target admitted at +%s): %d pings every %s from n1, %d lost, %d unreachable, %d looped",
			a, admitted.Sub(steady).Round(time.Millisecond), before.Sent, pingEvery, before.Lost, before.Unreachable, before.TimeExceeded)
		t.Logf("%s: trigger to the first answer from the target: %s; %d pings lost in between (of %d sent), %d unreachable, %d looped",
			a, answered[a].Sub(trigger).Round(time.Millisecond), during.Lost, during.Sent, during.Unreachable, during.TimeExceeded)
		t.Logf("%s: trigger to the end (the source pod deleted): %d sent, %d lost, %d unreachable, %d looped %v, %d sends failed",
			a, after.Sent, after.Lost, after.Unreachable, after.TimeExceeded, p.icmpErrors(), p.sendErrors())
	}
	for _, a := range []string{v4.String(), v6.String()} {
		p := pingers[a]
		f := p.figures(steady, end)
		require.Zero(t, f.Unreachable, "%s: no echo refused (ICMP destination unreachable): %v", a, p.icmpErrors())
		require.Zero(t, p.sendErrors(), "%s: no send failed in the client", a)
		// The target's node makes the cut-over, and routes the address to
		// the target before any other node may route it there.
		require.Zero(t, f.TimeExceeded, "%s: no routing loop between the nodes at the cut-over: %v", a, p.icmpErrors())
	}
	c.requireHistory(t, v4.String(), source, target)

	// The target's DEL: the addresses are kept for the identity.
	c.deletePod(t, migrationNS, target.Metadata.Name)
	require.NoError(t, waitFor(3*time.Minute, "the target's DEL keeps the addresses for the identity", func() error {
		if b := c.vmBinding(t); b.Owner.ContainerID != "" {
			return fmt.Errorf("held by %s/%s", b.Owner.Namespace, b.Owner.Pod)
		}
		return nil
	}))
	b := c.vmBinding(t)
	require.Nil(t, b.Alt)
	require.ElementsMatch(t, source.ips(), b.Addrs, "the identity keeps the VM's addresses")
	require.NotEmpty(t, b.KeptFor, "kept for the identity's window")
	out, err := c.kvipamctl("claim", "list", "--pool", "default")
	require.NoError(t, err)
	require.Contains(t, out, migrationNS+"/"+migrationVM)
	t.Logf("after the target's deletion, claim list:\n%s", strings.TrimSpace(out))
	out, err = c.kvipamctl("check")
	require.NoError(t, err, "kvipamctl check is clean: %s", out)
}

// requireHistory checks that ip history of addr shows the source pod's
// intervals ended by the cut-over (migrated: it owned the address) and
// by its DEL (alternate-ended: it was the second owner since), and the
// target's open (earlier pods of the same names, by UID, are left out);
// it logs them.
func (c *kcluster) requireHistory(tb testing.TB, addr string, source, target pod) {
	tb.Helper()
	out, err := c.kvipamctl("-o", "json", "ip", "history", addr)
	require.NoError(tb, err)
	var rows []struct {
		Pod     string `json:"pod"`
		PodUID  string `json:"podUID"`
		Node    string `json:"node"`
		Reason  string `json:"reason"`
		Current bool   `json:"current"`
	}
	require.NoError(tb, json.Unmarshal([]byte(out), &rows), "%s", out)
	var got, lines []string
	for _, r := range rows {
		by := r.Reason
		if r.Current {
			by = "(current)"
		}
		lines = append(lines, fmt.Sprintf("%s on %s: %s", r.Pod, r.Node, by))
		if r.PodUID == source.Metadata.UID || r.PodUID == target.Metadata.UID {
			got = append(got, r.Pod+" "+by)
		}
	}
	tb.Logf("ip history %s: %s", addr, strings.Join(lines, "; "))
	require.Equal(tb, []string{source.Metadata.Name + " migrated", source.Metadata.Name + " alternate-ended", target.Metadata.Name + " (current)"}, got,
		"ip history %s: the source's intervals as owner and as second owner, the target's open", addr)
}
