package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/announce"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/e2e/chaos"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/guestannounce"
	"github.com/kvipam/kvipam/kvstore"
)

// The chaos run's VMs (chaosVMs): each VM's launcher pod holds a sticky
// identity (kvipam.io/ip-claim), and the VM migrates between nodes as
// KubeVirt migrates it, under the run's faults: a target launcher pod
// (kubevirt.io/migrationJobName) is added on another node and admitted
// as the identity's alternate; then, at random, the migration cuts over
// (the guest announces itself on the target, or an operator runs
// kvipamctl ip migrate --cut-over) and the source pod's DEL ends it, or
// the target's DEL fails it, or the source's DEL comes first (the
// addresses are handed over). Now and then a VM stops (its pod's DEL)
// and starts again on any node, within its window: the same address.

// chaosVMCount is how many VMs a run has (none in a mixed-version run:
// the previous release knows no migration).
const chaosVMCount = 2

// chaosVMWindow is the VMs' sticky window: longer than any run, so a VM
// started again always gets its address back.
const chaosVMWindow = 10 * time.Minute

// chaosVMs runs the VMs of a chaos run.
type chaosVMs struct {
	w   *chaosWorkload
	c   *cluster.Cluster
	ctl string // HEAD's kvipamctl
	// What the VMs did, by the workload's decisions (the migration
	// writes etcd saw are counted from the recorder: figures).
	started, admitted, announced, operatorCutOvers, cutOverFailed, failed, handedOver, handedBack, stopped atomic.Int64
	mu                                                                                                     sync.Mutex
	guestCutOvers                                                                                          int
}

// vmLauncher is a VM's launcher pod on a node.
type vmLauncher struct {
	m       *chaosNode
	p       *pod
	release func()
	addr    netip.Addr
}

func (l *vmLauncher) owner() string { return l.p.rt.ContainerID + "/" + l.p.rt.IfName }

// run is VM id's life until the run's deadline; its pods live at the end
// stay (they must still hold the address).
func (v *chaosVMs) run(id int) {
	w := v.w
	rng := rand.New(rand.NewPCG(w.seed, uint64(id)+500))
	name := fmt.Sprintf("vm%d", id)
	identity := "e2e/" + name
	var src *vmLauncher
	live := func() bool { return time.Now().Before(w.deadline()) && !w.stopped.Load() }
	for gen := 0; live(); gen++ {
		if src == nil { // the VM starts, on any node
			src = v.launch(rng, name, fmt.Sprintf("virt-launcher-%s-%d", name, gen), "", nil)
			time.Sleep(time.Duration(500+rng.IntN(2000)) * time.Millisecond)
			continue
		}
		mig := fmt.Sprintf("kubevirt-migrate-%s-%d", name, gen)
		v.started.Add(1)
		dst := v.launch(rng, name, fmt.Sprintf("virt-launcher-%s-%d", name, gen), mig, src.m)
		if dst == nil {
			v.failed.Add(1) // not admitted (refused under a fault): its DEL is done
			continue
		}
		v.admitted.Add(1)
		time.Sleep(time.Duration(200+rng.IntN(2000)) * time.Millisecond) // the guest's memory copied
		if !live() {
			return // both live at the end
		}
		switch r := rng.IntN(10); {
		case r < 2: // the migration fails: KubeVirt deletes the target
			v.failed.Add(1)
			v.gone(dst)
		case r < 4: // the source goes before any cut-over: handed over
			v.handedOver.Add(1)
			v.gone(src)
			src = dst
		default:
			v.cutOver(rng, identity, dst)
			time.Sleep(time.Duration(100+rng.IntN(1500)) * time.Millisecond)
			if rng.IntN(8) == 0 { // the target dies after the cut-over: back to the source
				v.handedBack.Add(1)
				v.gone(dst)
				continue
			}
			v.gone(src) // the normal end: the source pod completes
			src = dst
		}
		if rng.IntN(6) == 0 && live() { // the VM stops
			v.stopped.Add(1)
			v.gone(src)
			src = nil
		}
	}
}

// launch adds VM name's launcher pod podName on a node other than not
// (nil: any), the target of migration mig ("" for a VM's start). A failed
// ADD is followed by its DEL, as a runtime does, and returns nil.
func (v *chaosVMs) launch(rng *rand.Rand, name, podName, mig string, not *chaosNode) *vmLauncher {
	w := v.w
	var m *chaosNode
	for m == nil || m == not {
		m = w.members[rng.IntN(len(w.members))]
	}
	if mig != "" {
		podName += "-target"
	}
	p, release, err := newEphemeralPod(w.t, podName)
	if err != nil {
		w.t.Errorf("VM %s: %v", name, err)
		return nil
	}
	ann := map[string]string{"kvipam.io/sticky": chaosVMWindow.String(), "kvipam.io/ip-claim": name}
	if mig != "" {
		ann["kubevirt.io/migrationJobName"] = mig
	}
	p.rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": ann}
	addr, ok := w.add(m, p, chaos.Op{Identity: "e2e/" + name, Window: chaosVMWindow, Migration: mig})
	l := &vmLauncher{m: m, p: p, release: release, addr: addr}
	if !ok {
		v.gone(l)
		return nil
	}
	return l
}

// gone is l's DEL, retried until it succeeds.
func (v *chaosVMs) gone(l *vmLauncher) {
	v.w.del(l.m, l.p)
	l.release()
}

// cutOver cuts the migration to dst over: half the time the guest
// announces itself on dst (a gratuitous ARP or QEMU's RARP from its
// namespace) and the run waits a few seconds for the binding to name
// dst; otherwise, or if it did not, an operator runs kvipamctl ip
// migrate --cut-over. A cut-over that fails (under a fault) may have
// landed or not: the run goes on either way, as KubeVirt would.
func (v *chaosVMs) cutOver(rng *rand.Rand, identity string, dst *vmLauncher) {
	if rng.IntN(2) == 0 {
		kind := announce.GratuitousARP
		if rng.IntN(2) == 0 {
			kind = announce.RARP
		}
		v.announced.Add(1)
		if err := guestannounce.Send(dst.p.ns.Path(), dst.p.rt.IfName, kind, dst.addr, nil); err != nil {
			v.w.t.Logf("VM %s: the guest's announcement from %s: %v", identity, dst.p.name, err)
		}
		for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if v.forwards(identity, dst) {
				v.mu.Lock()
				v.guestCutOvers++
				v.mu.Unlock()
				return
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	out, err := v.kvipamctl(ctx, "ip", "migrate", identity, "--pool", "chaos", "--cut-over")
	op := chaos.Op{Kind: "cutover", Identity: identity, Owner: dst.owner(), Start: start, End: time.Now()}
	if err != nil {
		op.Err = fmt.Sprintf("%v: %s", err, strings.TrimSpace(string(out)))
		v.cutOverFailed.Add(1)
		v.w.t.Logf("VM %s: kvipamctl ip migrate --cut-over to %s: %s", identity, dst.owner(), op.Err)
	} else {
		v.operatorCutOvers.Add(1)
	}
	v.w.record(op)
}

// forwards reports whether identity's binding names dst as the owner
// that forwards.
func (v *chaosVMs) forwards(identity string, dst *vmLauncher) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := v.w.faults.cli.Get(ctx, etcdstore.BindingKey("chaos", identity))
	if err != nil || len(resp.Kvs) == 0 {
		return false
	}
	b, err := kvstore.Decode[records.Binding](resp.Kvs[0])
	return err == nil && b.Value.Owner.Key() == dst.owner()
}

// kvipamctl runs HEAD's kvipamctl against the cluster, bounded by ctx.
func (v *chaosVMs) kvipamctl(ctx context.Context, args ...string) ([]byte, error) {
	f, err := v.c.ClientConfig(cluster.RootUser)
	if err != nil {
		return nil, err
	}
	args = append(args, "--endpoints", strings.Join(v.c.Endpoints(), ","), "--cacert", f.CAFile, "--cert", f.CertFile, "--key", f.KeyFile)
	return exec.CommandContext(ctx, filepath.Join(v.ctl, "kvipamctl"), args...).CombinedOutput()
}

// figures is the VMs' summary: what the workload did, and the migration
// writes etcd saw (from the bindings' changes).
func (v *chaosVMs) figures(bindings []chaos.BindingChange) string {
	e := chaos.CountMigrations(bindings)
	return fmt.Sprintf("vms=%d migrations: started=%d admitted=%d cut-over=%d (guest %d of %d announced, operator %d, operator failed %d) failed=%d handed-over=%d handed-back=%d vm-stops=%d; etcd: admits=%d cut-overs=%d hand-overs=%d alternates-dropped=%d",
		chaosVMCount, v.started.Load(), v.admitted.Load(), int64(v.guestCutOvers)+v.operatorCutOvers.Load(), v.guestCutOvers, v.announced.Load(), v.operatorCutOvers.Load(), v.cutOverFailed.Load(),
		v.failed.Load(), v.handedOver.Load(), v.handedBack.Load(), v.stopped.Load(),
		e.Admits, e.CutOvers, e.HandOvers, e.Drops)
}

// migrationFaultKinds are the faults aimed at a VM's migration, in a
// run's plan when it has VMs.
var migrationFaultKinds = []string{"agent-kill-mid-migration", "etcd-cut-mid-migration"}

// midMigration waits for a migration write (a binding naming an
// alternate: an admission, or a cut-over that kept the former owner) and
// at once kills the agent of one of its two nodes, or cuts that node off
// from etcd for 8 s (past its lease); with no migration written in 20 s
// it is skipped.
func (f *chaosFaults) midMigration(kind string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for resp := range f.cli.Watch(ctx, etcdstore.StickyPrefix("chaos"), clientv3.WithPrefix()) {
		for _, ev := range resp.Events {
			if ev.Type != clientv3.EventTypePut {
				continue
			}
			b, err := kvstore.Decode[records.Binding](ev.Kv)
			if err != nil || b.Value.Alternate == nil {
				continue
			}
			node, role := b.Value.Node, "the forwarding owner's"
			if f.rng.IntN(2) == 0 {
				node, role = b.Value.Alternate.Node, "the alternate's"
			}
			i := slices.IndexFunc(f.members, func(m *chaosNode) bool { return m.n.name == node })
			if i < 0 {
				continue
			}
			m := f.members[i]
			what := fmt.Sprintf("migration %s of %s at revision %d (owner %s on %s, alternate %s on %s): %s node %s",
				b.Value.Alternate.Migration, b.Value.Identity, ev.Kv.ModRevision, b.Value.Owner.Key(), b.Value.Node,
				b.Value.Alternate.Owner.Key(), b.Value.Alternate.Node, role, node)
			switch kind {
			case "agent-kill-mid-migration":
				f.log(kind, "SIGKILL agent right after %s", what)
				m.n.killAgent()
				m.n.startAgent(m.n.agentArgs)
				f.recoveries++
			default:
				f.log(kind, "cut off from etcd for 8s (lease TTL 5s; packets dropped) right after %s", what)
				for _, p := range m.proxies {
					p.Stall()
				}
				time.Sleep(8 * time.Second)
				for _, p := range m.proxies {
					p.Heal()
				}
			}
			return
		}
	}
	f.skip(kind, "no migration written in 20s")
}
