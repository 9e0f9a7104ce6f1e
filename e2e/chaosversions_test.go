package e2e

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/releasetest"
)

// A mixed-version chaos run (CHAOS_MIXED=v0.1.0 make chaos, and its short
// form TestMixedVersionChaos): each node starts on the previous release's
// binaries or on HEAD's, and the run upgrades nodes and rolls them back
// beside the faults, as an operator does (docs/operations.md, "Rolling
// back"): node by node, the downgrade enabled before the first node goes
// back, cancelled once every node runs HEAD again.

// TestMixedVersionChaos is the mixed-version chaos run's short form
// (make test): 3 nodes, each starting on the previous release or on HEAD
// at random, for 90 s; every fault kind and every version step fires once
// in order first (the run lasts until they have), and the history checker
// proves no duplicate, no lost allocation and no leak over the whole run.
// CHAOS_SEED replays a run.
func TestMixedVersionChaos(t *testing.T) {
	requireRoot(t)
	runChaos(t, chaosConfig{seed: chaosSeed(t), duration: 90 * time.Second, nodes: 3, mixed: previousRelease})
}

// headVersion names the build under test in a run's logs.
const headVersion = "HEAD"

// versionSteps are the steps a mixed run chooses beside the faults.
var versionSteps = []string{"upgrade", "rollback"}

// versionStepKinds are every step a mixed run takes and counts, each at
// least once: the two it chooses, and the operator's procedure around
// them.
var versionStepKinds = []string{"upgrade", "rollback", "downgrade-enable", "downgrade-cancel", "level-raised", "feature-set", "feature-refused", "feature-cleared"}

// chaosPool is the chaos run's pool (joinChaos), whose max-blocks the
// operator sets while every node runs HEAD.
const chaosPool = "chaos"

// kvipamBinaries are the files a node upgrade replaces: the agent, its
// command-line tool and the two CNI plugins.
var kvipamBinaries = []string{"kvipam-agent", "kvipamctl", "kvipam", "kvipam-ipam"}

// chaosBuild is a build a node can run: its name and its bin directory.
type chaosBuild struct{ version, dir string }

// nodeBins is a node's own directory of kvipam's binaries, each a
// symbolic link to one build's file. A node upgrade replaces them all
// while the agent is stopped, as a package upgrade replaces
// /usr/bin/kvipam-agent and /opt/cni/bin/kvipam; each link is replaced by
// a rename, so a plugin started meanwhile runs one build or the other.
type nodeBins struct{ dir string }

func newNodeBins(t testing.TB, dir, from string) *nodeBins {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o755))
	b := &nodeBins{dir: dir}
	require.NoError(t, b.install(from))
	return b
}

// install links the node's binaries to those of the build in from.
func (b *nodeBins) install(from string) error {
	for _, name := range kvipamBinaries {
		tmp := filepath.Join(b.dir, "."+name+".new")
		_ = os.Remove(tmp)
		if err := os.Symlink(filepath.Join(from, name), tmp); err != nil {
			return fmt.Errorf("install %s: %w", name, err)
		}
		if err := os.Rename(tmp, filepath.Join(b.dir, name)); err != nil {
			return fmt.Errorf("install %s: %w", name, err)
		}
	}
	return nil
}

// chaosVersions takes a mixed run's version steps. The faults restart a
// node's agent on whatever build it is on. After a rollback the
// procedure holds the cluster's level at the release's while a node runs
// it (the downgrade is enabled first); during an upgrade nothing holds
// it but the nodes: a node on the release paused or cut off past its
// lease (or down) is not live, but while it holds blocks it is away and
// the agents wait for it (etcdstore.ErrNodesAway); one that holds
// nothing, or has not joined yet, is not counted. The run counts the
// steps that find a node on the release below the cluster's level
// (release-below-level). A fault may
// then restart that node's agent above its level, the operator's mistake
// the procedure forbids, which HEAD cannot stop: v0.1.0 predates levels
// and starts all the same; kvipamctl check reports the node below-schema
// and kvipamctl version marks it, the agents never lower the level,
// set-max-blocks is refused while the node lives, but a max-blocks set
// while it was not live is lost on it (it claims past the limit).
type chaosVersions struct {
	t       *testing.T
	release chaosBuild
	head    chaosBuild
	rng     *rand.Rand
	members []*chaosNode
	// ctl is HEAD's kvipamctl: the operator's, whatever the nodes run;
	// store reads the cluster's level.
	ctl   func(args ...string) ([]byte, error)
	store *etcdstore.Store
	// downgrade is set while a downgrade to the release is enabled, and
	// feature while the chaos pool's max-blocks is set.
	downgrade, feature bool
	byKind             map[string]int
}

// newChaosVersions builds release from git (releasetest) for a run of
// nodes beside HEAD's binaries in head.
func newChaosVersions(t *testing.T, release, head string, rng *rand.Rand, nodes int) *chaosVersions {
	t.Helper()
	require.GreaterOrEqual(t, nodes, 2, "a mixed run needs two nodes at least (CHAOS_NODES)")
	start := time.Now()
	dir := releasetest.Build(t, release)
	t.Logf("chaos: built %s from git in %s", release, time.Since(start).Round(time.Second))
	return &chaosVersions{t: t, release: chaosBuild{version: release, dir: dir}, head: chaosBuild{version: headVersion, dir: head}, rng: rng, byKind: map[string]int{}}
}

// startBuilds chooses each node's build at random, one of each at least.
func (v *chaosVersions) startBuilds(nodes int) []chaosBuild {
	rel := v.rng.IntN(nodes)
	head := (rel + 1 + v.rng.IntN(nodes-1)) % nodes
	builds := make([]chaosBuild, nodes)
	for i := range builds {
		switch {
		case i == rel:
			builds[i] = v.release
		case i == head:
			builds[i] = v.head
		default:
			builds[i] = []chaosBuild{v.release, v.head}[v.rng.IntN(2)]
		}
	}
	return builds
}

// joinOrder is the order the nodes of builds join in: those on the
// release first, as in an upgrade in progress, where every node ran the
// release before some were upgraded. HEAD's agents raise the level to
// the lowest live node's, so a HEAD node that joined first would raise
// it above the release's nodes that join after it.
func joinOrder(builds []chaosBuild) []int {
	order := make([]int, len(builds))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Compare(rank(builds[a]), rank(builds[b]))
	})
	return order
}

// rank sorts HEAD after every release.
func rank(b chaosBuild) int {
	if b.version == headVersion {
		return 1
	}
	return 0
}

// begin starts the version steps of a run of members, on etcd through
// cli and HEAD's kvipamctl ctl.
func (v *chaosVersions) begin(members []*chaosNode, cli *clientv3.Client, ctl func(args ...string) ([]byte, error)) {
	v.members, v.ctl, v.store = members, ctl, etcdstore.New(cli, etcdstore.Options{})
	for _, m := range members {
		v.checkRuns(m)
		v.t.Logf("chaos: node %s starts on %s (its agent reports %q)", m.n.name, m.version, m.n.status().Version)
	}
	v.tryFeature()
}

// plan is the run's ordered phase: the faults, each once, with the
// version steps that fire every kind interleaved with the last of them:
// an upgrade of each node on the release (the last one raises the level
// and sets the feature), a rollback (the feature cleared, the downgrade
// enabled first), and an upgrade again (the downgrade cancelled). The
// first faults (a pause and a cut past the lease among them) meet the
// cluster as it starts, an upgrade in progress with no downgrade held.
func (v *chaosVersions) plan(faults []string) []string {
	var steps []string
	for range v.on(v.release.version) {
		steps = append(steps, "upgrade")
	}
	steps = append(steps, "rollback", "upgrade")
	first := max(0, len(faults)-len(steps))
	plan := slices.Clone(faults[:first])
	for i, f := range faults[first:] {
		plan = append(plan, f, steps[i])
	}
	return append(plan, steps[min(len(steps), len(faults)-first):]...)
}

// on is the members running version.
func (v *chaosVersions) on(version string) []*chaosNode {
	var ms []*chaosNode
	for _, m := range v.members {
		if m.version == version {
			ms = append(ms, m)
		}
	}
	return ms
}

func (v *chaosVersions) log(kind, format string, args ...any) {
	v.byKind[kind]++
	v.t.Logf("step %s at %s: %s", kind, time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// step takes an upgrade or a rollback; with no node to take it from (an
// upgrade with every node on HEAD), it takes the other.
func (v *chaosVersions) step(kind string) {
	v.checkLevel()
	if kind == "upgrade" && len(v.on(v.release.version)) == 0 {
		kind = "rollback"
	}
	if kind == "rollback" && len(v.on(headVersion)) == 0 {
		kind = "upgrade"
	}
	switch kind {
	case "upgrade":
		ms := v.on(v.release.version)
		m := ms[v.rng.IntN(len(ms))]
		v.switchTo(m, v.head)
		v.log(kind, "node %s from %s to %s", m.n.name, v.release.version, headVersion)
		if len(v.on(v.release.version)) == 0 {
			v.completeUpgrade()
		} else {
			v.tryFeature()
		}
	case "rollback":
		if !v.downgrade {
			v.prepareRollback()
		}
		ms := v.on(headVersion)
		m := ms[v.rng.IntN(len(ms))]
		v.switchTo(m, v.release)
		v.log(kind, "node %s from %s to %s", m.n.name, headVersion, v.release.version)
		v.tryFeature()
	}
}

// checkLevel counts and logs a node on the release running below the
// cluster's level: raised by the agents while it was not live.
func (v *chaosVersions) checkLevel() {
	old := v.on(v.release.version)
	if len(old) == 0 {
		return
	}
	set, err := v.store.ReadSchema(context.Background())
	if err != nil {
		v.t.Logf("chaos: read the cluster's level: %v", err)
		return
	}
	if set.Level > schema.Base {
		out, _ := v.ctl("version")
		v.log("release-below-level", "%s on %s below the cluster's level %d, raised by %s at %s while it was not live:\n%s",
			names(old), v.release.version, set.Level, set.By, set.At.UTC().Format("15:04:05.000"), out)
	}
}

// names are ms's node names.
func names(ms []*chaosNode) string {
	ns := make([]string, len(ms))
	for i, m := range ms {
		ns[i] = m.n.name
	}
	return strings.Join(ns, ", ")
}

// switchTo stops m's agent as a service manager does (SIGTERM, then
// waits for it), switches m's binaries to build's, and starts the agent
// again, waiting until it is ready.
func (v *chaosVersions) switchTo(m *chaosNode, build chaosBuild) {
	m.n.stopAgent()
	require.NoError(v.t, m.bins.install(build.dir), "switch node %s to %s", m.n.name, build.version)
	m.version = build.version
	m.n.startAgent(m.n.agentArgs)
	v.checkRuns(m)
}

// checkRuns checks that m's agent is the build m is on: the release's
// reports the release's version (releasetest stamps it), HEAD's another.
func (v *chaosVersions) checkRuns(m *chaosNode) {
	got := m.n.status().Version
	if (got == v.release.version) != (m.version == v.release.version) {
		v.t.Errorf("node %s is on %s, but its agent reports version %q", m.n.name, m.version, got)
	}
}

// prepareRollback is the operator's procedure before the first node goes
// back to the release: no pool uses a feature of a level above the
// release's, then the downgrade is enabled, which pins the cluster's
// level at the release's.
func (v *chaosVersions) prepareRollback() {
	if v.feature {
		v.operator("feature-cleared", "pool", "set-max-blocks", chaosPool, "none")
		v.feature = false
	}
	v.operator("downgrade-enable", "downgrade", "enable", v.release.version)
	v.downgrade = true
}

// completeUpgrade is the operator's procedure once every node runs HEAD:
// the downgrade cancelled (if one was enabled), HEAD's level awaited (the
// agents raise it), and the feature set, so that it shapes HEAD's nodes'
// claims until the next rollback.
func (v *chaosVersions) completeUpgrade() {
	if v.downgrade {
		v.operator("downgrade-cancel", "downgrade", "cancel")
		v.downgrade = false
	}
	v.awaitLevel(schema.Highest())
	v.operator("feature-set", "pool", "set-max-blocks", chaosPool, "2")
	v.feature = true
}

// tryFeature asks for the feature while a node runs the release: the
// gate must refuse it.
func (v *chaosVersions) tryFeature() {
	old := v.on(v.release.version)
	if len(old) == 0 {
		return
	}
	out, err := v.ctl("pool", "set-max-blocks", chaosPool, "2")
	if err == nil {
		v.t.Errorf("kvipamctl pool set-max-blocks accepted while %s run %s:\n%s", names(old), v.release.version, out)
		v.feature = true // cleared before the next rollback
		return
	}
	v.log("feature-refused", "set-max-blocks while %s run %s: %s", names(old), v.release.version, strings.TrimSpace(string(out)))
}

// operator runs one of the operator's commands, which must succeed.
func (v *chaosVersions) operator(kind string, args ...string) {
	out, err := v.ctl(args...)
	require.NoError(v.t, err, "kvipamctl %s:\n%s", strings.Join(args, " "), out)
	v.log(kind, "kvipamctl %s", strings.Join(args, " "))
}

// awaitLevel waits until the agents have raised the cluster's level to
// level, following the schema key.
func (v *chaosVersions) awaitLevel(level schema.Level) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	h := &levelWatch{want: level, reached: make(chan etcdstore.SchemaSetting, 1)}
	done := make(chan error, 1)
	go func() { done <- v.store.WatchSchema(ctx, h) }()
	defer func() { cancel(); <-done }()
	select {
	case set := <-h.reached:
		v.log("level-raised", "the cluster's level is %d, raised by %s (%s) at %s", set.Level, set.By, set.Version, set.At.UTC().Format("15:04:05.000"))
	case <-ctx.Done():
		out, _ := v.ctl("version")
		v.t.Fatalf("the cluster's level did not reach %d in 2 minutes (the agents raise it once every live node understands it):\n%s", level, out)
	}
}

// levelWatch hands the first schema setting at a level of want or
// above, not held by a downgrade, to reached.
type levelWatch struct {
	want    schema.Level
	reached chan etcdstore.SchemaSetting
}

func (h *levelWatch) Reset(all []etcdstore.SchemaSetting) {
	for _, s := range all {
		h.Put(s)
	}
}

func (h *levelWatch) Put(s etcdstore.SchemaSetting) {
	if s.Level >= h.want && !s.Downgrade {
		select {
		case h.reached <- s:
		default: // handed over already
		}
	}
}

func (h *levelWatch) Delete(etcdstore.SchemaSetting) {} // level 1: not reached

// figures are the step counts for the run's summary line.
func (v *chaosVersions) figures() string {
	var fs []string
	for _, k := range slices.Concat(versionStepKinds, []string{"release-below-level"}) {
		fs = append(fs, fmt.Sprintf("%s=%d", k, v.byKind[k]))
	}
	return "steps: " + strings.Join(fs, " ")
}

// report fails the run if a step kind never fired: the ordered phase
// fires each of them.
func (v *chaosVersions) report() {
	for _, k := range versionStepKinds {
		if v.byKind[k] == 0 {
			v.t.Errorf("version step %s never fired", k)
		}
	}
	v.checkLevel()
	final := map[string][]string{}
	for _, m := range v.members {
		final[m.version] = append(final[m.version], m.n.name)
	}
	v.t.Logf("chaos: %s; nodes at the end: %v", v.figures(), final)
}
