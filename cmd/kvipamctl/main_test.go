package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// harness runs kvipamctl in-process against one embedded etcd.
type harness struct {
	t   *testing.T
	e   *kvstore.Embedded
	cli *clientv3.Client
	env map[string]string
}

func newHarness(t *testing.T) *harness {
	e := etcdtest.Start(t)
	return &harness{t: t, e: e, cli: etcdtest.Client(t, e),
		env: map[string]string{envEndpoints: strings.Join(e.Endpoints(), ","), "USER": "tester"}}
}

// run runs kvipamctl with args and returns exit code, stdout and stderr.
func (h *harness) run(args ...string) (int, string, string) {
	h.t.Helper()
	var out, errb bytes.Buffer
	code := Run(context.Background(), args, &out, &errb, func(k string) string { return h.env[k] })
	return code, out.String(), errb.String()
}

// json runs kvipamctl with -o json, decodes stdout into v and returns the
// exit code.
func (h *harness) json(v any, args ...string) int {
	h.t.Helper()
	code, out, errs := h.run(append(args, "-o", "json")...)
	require.NoError(h.t, json.Unmarshal([]byte(out), v), "stdout %q, stderr %q", out, errs)
	return code
}

// ok runs kvipamctl and requires exit 0.
func (h *harness) ok(args ...string) string {
	h.t.Helper()
	code, out, errs := h.run(args...)
	require.Equal(h.t, exitOK, code, "kvipamctl %v: stdout %q, stderr %q", args, out, errs)
	return out
}

func (h *harness) agent(name string) *agenttest.Agent {
	return agenttest.Start(h.t, h.e, name, agenttest.Options{Pools: []string{"small"}, ReservationTTL: time.Minute})
}

func (h *harness) put(key string, v any, opts ...clientv3.OpOption) {
	h.t.Helper()
	b, err := json.Marshal(v)
	require.NoError(h.t, err)
	_, err = h.cli.Put(context.Background(), key, string(b), opts...)
	require.NoError(h.t, err)
}

func (h *harness) count(prefix string) int64 {
	h.t.Helper()
	resp, err := h.cli.Get(context.Background(), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(h.t, err)
	return resp.Count
}

// withSmallPool creates the pool the agents use: 16 blocks of /28.
func (h *harness) withSmallPool() {
	h.ok("pool", "create", "small", "--cidr", "10.20.0.0/24", "--block-size-v4", "28")
}

func TestVersionNeedsNoEtcd(t *testing.T) {
	h := &harness{t: t, env: map[string]string{}}
	var v versionInfo
	require.Equal(t, exitOK, h.json(&v, "version"))
	require.Equal(t, etcdstore.Prefix, v.Schema)
	require.NotEmpty(t, v.Version)
	require.Contains(t, h.ok("version"), "etcd schema")
}

func TestUsageErrors(t *testing.T) {
	h := &harness{t: t, env: map[string]string{}}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no endpoints", []string{"pool", "list"}, "no etcd endpoints: pass --endpoints or set KVIPAM_ETCD_ENDPOINTS"},
		{"unknown output", []string{"pool", "list", "-o", "yaml"}, `unknown output format "yaml"`},
		{"unknown command", []string{"frobnicate"}, "unknown command"},
		{"release needs a target", []string{"release", "--endpoints", "http://127.0.0.1:1"}, "at least one of the flags"},
		{"release targets are exclusive", []string{"release", "--ip", "10.0.0.1", "--node", "n1"}, "none of the others can be"},
		{"ifname without owner", []string{"release", "--node", "n1", "--ifname", "eth0", "--endpoints", "x"}, "--ifname goes with --owner"},
		{"bad ip", []string{"release", "--ip", "10.0.0.300", "--endpoints", "x"}, "parse --ip"},
		{"bad state filter", []string{"ip", "list", "--state", "gone", "--endpoints", "x"}, `state "gone"`},
		{"unreachable etcd", []string{"pool", "list", "--endpoints", "http://127.0.0.1:1", "--dial-timeout", "200ms"}, "reach etcd"},
		{"node remove needs a name", []string{"node", "remove"}, "accepts 1 arg"},
		{"bad last-seen", []string{"node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", "yesterday", "--endpoints", "x"}, `parse --last-seen "yesterday"`},
		{"negative last-seen", []string{"node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", "-2h", "--endpoints", "x"}, `parse --last-seen "-2h"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errs := h.run(tc.args...)
			require.Equal(t, exitError, code)
			require.Contains(t, errs, tc.want)
			require.True(t, strings.HasPrefix(errs, "kvipamctl: "), "one clear line: %q", errs)
		})
	}
}

func TestParseLastSeen(t *testing.T) {
	now := time.Date(2026, 1, 22, 10, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2026-01-22T07:40:00Z":      time.Date(2026, 1, 22, 7, 40, 0, 0, time.UTC),
		"2026-01-22T08:40:00+01:00": time.Date(2026, 1, 22, 7, 40, 0, 0, time.UTC),
		"2026-01-22T07:40:00.5Z":    time.Date(2026, 1, 22, 7, 40, 0, 5e8, time.UTC),
		"2h":                        time.Date(2026, 1, 22, 8, 0, 0, 0, time.UTC),
		"90m":                       time.Date(2026, 1, 22, 8, 30, 0, 0, time.UTC),
		"0s":                        now,
	} {
		got, err := parseLastSeen(in, now)
		require.NoError(t, err, in)
		require.True(t, want.Equal(got), "%s: got %s, want %s", in, got, want)
	}
	for _, in := range []string{"", "yesterday", "-1h", "2026-01-22 07:40"} {
		_, err := parseLastSeen(in, now)
		require.Error(t, err, in)
	}
}

func TestPoolCommands(t *testing.T) {
	h := newHarness(t)
	var p allocator.Pool
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "small", "--cidr", "10.20.0.0/24", "--block-size-v4", "28"))
	require.Equal(t, allocator.Pool{Name: "small", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/24")}, BlockSizeV4: 28}, p)
	require.Equal(t, exitOK, h.json(&p, "pool", "create", "dual", "--cidr", "10.30.0.0/16", "--cidr", "fd00:30::/64"))
	require.Equal(t, 26, p.BlockSizeV4, "default block sizes")
	require.Equal(t, 120, p.BlockSizeV6)
	h.ok("pool", "create", "small", "--cidr", "10.20.0.0/24", "--block-size-v4", "28") // again: no-op

	code, _, errs := h.run("pool", "create", "small", "--cidr", "10.20.0.0/24", "--block-size-v4", "27")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "block size is immutable")
	code, _, errs = h.run("pool", "create", "bad", "--cidr", "10.0.0.0/33")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, `parse --cidr "10.0.0.0/33"`)

	n1 := agenttest.Start(t, h.e, "n1", agenttest.Options{Pools: []string{"dual", "small"}})
	n1.Allocate(t, "dual", 0, 3, false)

	var list []poolEntry
	require.Equal(t, exitOK, h.json(&list, "pool", "list"))
	require.Len(t, list, 2)
	require.Equal(t, "dual", list[0].Name)
	require.Len(t, list[0].Usage, 2)
	require.Equal(t, "18446744073709551615", list[0].Usage[1].Addresses.String(), "a /64 less its anycast address")
	require.Equal(t, 3, list[0].Usage[1].Allocated)

	var d poolDetail
	require.Equal(t, exitOK, h.json(&d, "pool", "show", "small"))
	require.Equal(t, "small", d.Pool.Name)
	require.Equal(t, "254", d.Usage[0].Addresses.String())
	require.Equal(t, uint64(16), d.Usage[0].FreeBlocks)

	require.Contains(t, h.ok("pool", "list"), "NAME")
	require.Contains(t, h.ok("pool", "show", "dual"), "free blocks")
	code, _, errs = h.run("pool", "show", "nope")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, `pool "nope": allocator: pool not found`)
}

func TestListCommands(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1, n2 := h.agent("n1"), h.agent("n2")
	n1.Allocate(t, "small", 0, 20, false)
	n2.Allocate(t, "small", 100, 4, true)
	n1.Kill(t)

	var blocks []inspect.BlockRow
	require.Equal(t, exitOK, h.json(&blocks, "block", "list", "--pool", "small"))
	states := map[inspect.BlockState]int{}
	for _, b := range blocks {
		states[b.State]++
	}
	require.Equal(t, map[inspect.BlockState]int{inspect.BlockOrphaned: 2, inspect.BlockClaimed: 1}, states)
	require.Equal(t, exitOK, h.json(&blocks, "block", "list", "--pool", "other"))
	require.Empty(t, blocks)

	var ips []inspect.IP
	require.Equal(t, exitOK, h.json(&ips, "ip", "list", "--node", "n2", "--state", "reserved"))
	require.Len(t, ips, 4)
	require.Equal(t, exitOK, h.json(&ips, "ip", "list", "--owner", "ctr-0005"))
	require.Len(t, ips, 1)
	require.Equal(t, "n1", ips[0].Node)
	require.Equal(t, exitOK, h.json(&ips, "ip", "list", "--pool", "small", "--state", "allocated"))
	require.Len(t, ips, 20)

	var nodes []inspect.NodeRow
	require.Equal(t, exitOK, h.json(&nodes, "node", "list"))
	require.Equal(t, []inspect.NodeRow{{Node: "n1", Homes: 2, IPs: 20}, {Node: "n2", Alive: true, Claims: 1, Homes: 1, IPs: 4}}, nodes)

	out := h.ok("ip", "list", "--owner", "ctr-0005")
	require.Contains(t, out, "POOL")
	require.Contains(t, out, "default/pod-5")
	require.Contains(t, h.ok("block", "list"), "orphaned")
}

func TestCheck(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1, n2 := h.agent("n1"), h.agent("n2")
	held := n1.Allocate(t, "small", 0, 5, false)
	n2.Allocate(t, "small", 100, 2, true)

	var r inspect.Report
	require.Equal(t, exitOK, h.json(&r, "check"))
	require.Empty(t, r.Findings)
	require.NotNil(t, r.Findings, "an empty list, not null")
	require.Contains(t, h.ok("check"), "no problems found")

	// Plant one of each fault, as an operator with etcdctl (or a crash)
	// would leave them.
	al := held[0]
	// A second owner of n1's address, under another block key.
	h.put(etcdstore.IPsPrefix("small")+"10.20.0.0-24/"+al.Addr.String(), al.Record)
	// The same owner holding a second address of the family.
	h.put(etcdstore.IPKey("small", al.Block, next(al.Block, 14)), al.Record)
	// A claim on a live lease for a node without node record.
	lease, err := h.cli.Grant(context.Background(), 60)
	require.NoError(t, err)
	ghostBlock := h.freeBlock()
	h.put(etcdstore.ClaimKey("small", ghostBlock), records.Claim{Node: "ghost"}, clientv3.WithLease(lease.ID))
	// A reservation that has no lease.
	h.put(etcdstore.IPKey("small", al.Block, next(al.Block, 13)), records.Record{
		Owner: agenttest.Owner(50), Node: "n1", State: records.StateReserved, Since: time.Now().UTC()})
	// And n1 dies: its block is orphaned.
	n1.Kill(t)

	code := h.json(&r, "check")
	require.Equal(t, exitFindings, code)
	got := map[inspect.Kind][]string{}
	for _, f := range r.Findings {
		got[f.Kind] = append(got[f.Kind], f.Keys...)
	}
	require.Contains(t, got[inspect.KindDuplicateIP], etcdstore.IPKey("small", al.Block, al.Addr))
	require.Contains(t, got[inspect.KindDuplicateOwner], etcdstore.IPKey("small", al.Block, next(al.Block, 14)))
	require.Contains(t, got[inspect.KindDeadNodeClaim], etcdstore.ClaimKey("small", ghostBlock))
	require.Contains(t, got[inspect.KindExpiredReservation], etcdstore.IPKey("small", al.Block, next(al.Block, 13)))
	require.Contains(t, got[inspect.KindOrphanedBlock], etcdstore.HomeKey("small", al.Block))

	code, out, _ := h.run("check")
	require.Equal(t, exitFindings, code)
	require.Contains(t, out, "problems found")
	require.Contains(t, out, "dead-node-claim")
}

// freeBlock returns a block of small that block list does not show.
func (h *harness) freeBlock() netip.Prefix {
	h.t.Helper()
	var rows []inspect.BlockRow
	require.Equal(h.t, exitOK, h.json(&rows, "block", "list"))
	used := map[netip.Prefix]bool{}
	for _, r := range rows {
		used[r.Block] = true
	}
	for i := range uint64(16) {
		b, err := allocator.BlockAt(netip.MustParsePrefix("10.20.0.0/24"), 28, i)
		require.NoError(h.t, err)
		if !used[b] {
			return b
		}
	}
	h.t.Fatal("no free block")
	return netip.Prefix{}
}

func next(b netip.Prefix, off int) netip.Addr {
	a, _ := allocator.AddrAt(b, off)
	return a
}

func TestRelease(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	held := n1.Allocate(t, "small", 0, 10, false)
	ip := held[2].Addr.String()

	code, _, errs := h.run("release", "--ip", ip, "--pool", "small")
	require.Equal(t, exitError, code, "n1 is alive")
	require.Contains(t, errs, "node is alive: n1")
	require.Contains(t, errs, "--force")

	n1.Kill(t)
	gone := []string{"--confirm-gone", "n1", "--last-seen", "0s"}
	var rep planReport
	require.Equal(t, exitOK, h.json(&rep, append([]string{"release", "--ip", ip, "--pool", "small", "--dry-run"}, gone...)...))
	require.True(t, rep.DryRun)
	require.Nil(t, rep.Result)
	require.Len(t, rep.Plan.Steps, 1)
	require.Equal(t, etcdstore.IPKey("small", held[2].Block, held[2].Addr), rep.Plan.Steps[0].Key)
	require.Equal(t, int64(10), h.count(etcdstore.IPsPrefix("small")), "a dry run changes nothing")

	code, out, errs := h.run(append([]string{"release", "--ip", ip, "-o", "json"}, gone...)...)
	require.Equal(t, exitOK, code, errs)
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, 1, rep.Result.Deleted)
	require.Equal(t, int64(9), h.count(etcdstore.IPsPrefix("small")))
	require.Contains(t, errs, "deleted key")
	require.Contains(t, errs, "operator=tester")
	require.Contains(t, errs, rep.Plan.Steps[0].Key)
	var hist []historyRow
	require.Equal(t, exitOK, h.json(&hist, "ip", "history", ip))
	require.Len(t, hist, 1, "the released interval is in IP history")
	require.Equal(t, etcdstore.EndOperatorRelease, hist[0].Reason)
	require.Equal(t, held[2].ContainerID, hist[0].ContainerID)

	require.Equal(t, exitOK, h.json(&rep, "release", "--ip", ip))
	require.Empty(t, rep.Plan.Steps, "releasing again finds nothing")
	require.Contains(t, h.ok("release", "--ip", ip), "nothing to do")

	require.Equal(t, exitOK, h.json(&rep, append([]string{"release", "--owner", "ctr-0004", "--ifname", "eth0"}, gone...)...))
	require.Equal(t, 1, rep.Result.Deleted)
	require.Equal(t, exitOK, h.json(&rep, append([]string{"release", "--node", "n1", "--dry-run"}, gone...)...))
	require.Len(t, rep.Plan.Steps, 8)
	out = h.ok(append([]string{"release", "--node", "n1"}, gone...)...)
	require.Contains(t, out, "8 keys deleted, 0 failed, 0 skipped")
	require.Zero(t, h.count(etcdstore.IPsPrefix("small")))
}

// TestReleaseNeedsEvidence: release of addresses of a node without a node
// record (here its lease revoked, as after a partition longer than its
// TTL) is refused until the operator states that the node is gone, with
// the flags node remove takes; the refusal names them.
func TestReleaseNeedsEvidence(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	held := n1.Allocate(t, "small", 0, 4, false)
	n1.Kill(t) // its node record goes; its pods may still run
	lastSeen := time.Now().UTC().Format(time.RFC3339Nano)
	for _, args := range [][]string{
		{"release", "--ip", held[0].Addr.String()},
		{"release", "--owner", held[1].ContainerID},
		{"release", "--node", "n1"},
		{"release", "--node", "n1", "--force"},
		{"release", "--node", "n1", "--dry-run"},
	} {
		code, _, errs := h.run(args...)
		require.Equal(t, exitError, code, "%v", args)
		require.Contains(t, errs, "lease TTL", "%v: the refusal says why a missing record is no proof", args)
		require.Contains(t, errs, "--confirm-gone n1 --last-seen TIME", "%v: the refusal names the flags to add", args)
	}
	code, _, errs := h.run("release", "--node", "n1", "--confirm-gone", "n1", "--last-seen", "1h")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "alive after", "etcd contradicts a last-seen before n1's allocations")
	require.Contains(t, errs, "state a later --last-seen")
	require.Equal(t, int64(4), h.count(etcdstore.IPsPrefix("small")), "nothing was released")

	var rep planReport
	code, out, errs := h.run("release", "--ip", held[0].Addr.String(), "--confirm-gone", "n1", "--last-seen", lastSeen, "-o", "json")
	require.Equal(t, exitOK, code, errs)
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, 1, rep.Result.Deleted)
	require.Equal(t, "n1", rep.Plan.Evidence.ConfirmGone)
	require.Contains(t, errs, "confirmGone=n1", "the audit trail records the evidence")
	out = h.ok("release", "--node", "n1", "--confirm-gone", "n1", "--last-seen", lastSeen)
	require.Contains(t, out, "3 keys deleted, 0 failed, 0 skipped")
	require.Contains(t, out, "evidence: tester states n1 is gone")
	require.Zero(t, h.count(etcdstore.IPsPrefix("small")))
}

func TestReleaseForce(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	n1.Allocate(t, "small", 0, 2, false)
	var rep planReport
	require.Equal(t, exitOK, h.json(&rep, "release", "--owner", "ctr-0001", "--force"))
	require.True(t, rep.Plan.Force)
	require.Equal(t, 1, rep.Result.Deleted)
	require.Equal(t, int64(1), h.count(etcdstore.IPsPrefix("small")))
	code, _, errs := h.run("release", "--owner", "ctr-0000", "--force", "--dry-run")
	require.Equal(t, exitOK, code)
	require.Contains(t, errs, "node n1 is alive", "a forced release of a live node's address says it may come back")
	require.Contains(t, errs, "writes the allocation back at its next reconciler pass (every gcInterval, 30 s by default)")
}

func TestNodeRemove(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	n1.Allocate(t, "small", 0, 20, false)

	gone := []string{"node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", "0s"}
	code, _, errs := h.run(gone...)
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "rerun with --force", "evidence does not override a live node record")

	n1.Kill(t)
	var rep planReport
	require.Equal(t, exitOK, h.json(&rep, append(gone, "--dry-run")...))
	require.Len(t, rep.Plan.Steps, 22, "20 addresses and 2 homes")
	require.Equal(t, int64(20), h.count(etcdstore.IPsPrefix("small")), "a dry run changes nothing")
	require.Equal(t, int64(2), h.count(etcdstore.HomesPrefix("small")))
	require.Equal(t, "n1", rep.Plan.Evidence.ConfirmGone)
	require.Equal(t, "tester", rep.Plan.Evidence.StatedBy)
	out := h.ok(append(gone, "--dry-run")...)
	require.Contains(t, out, "nothing changed")
	require.Contains(t, out, "evidence: tester states n1 is gone")

	code, out, errs = h.run(append(gone, "-o", "json")...)
	require.Equal(t, exitOK, code, errs)
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, 22, rep.Result.Deleted)
	require.Equal(t, 22, strings.Count(errs, "deleted key"), "one audit line per key")
	require.Zero(t, h.count(etcdstore.IPsPrefix("small")))
	require.Zero(t, h.count(etcdstore.HomesPrefix("small")))
	var hist []historyRow
	require.Equal(t, exitOK, h.json(&hist, "ip", "history", rep.Plan.Steps[0].Addr.String()))
	require.Len(t, hist, 1, "the interval node remove ended is in IP history")
	require.Equal(t, etcdstore.EndNodeRemove, hist[0].Reason)
	require.Equal(t, "n1", hist[0].Node)

	var r inspect.Report
	require.Equal(t, exitOK, h.json(&r, "check"))

	// Every block is free: a new node can take the whole pool.
	n2 := h.agent("n2")
	n2.Allocate(t, "small", 100, 254, false)
	require.Equal(t, exitOK, h.json(&r, "check"))
}

func TestProgress(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	// 10,000 allocation keys in 80 transactions (etcd allows 128 ops each).
	val := `{"containerID":"c","ifName":"eth0","node":"gone","state":"allocated"}`
	for i := 0; i < 10000; i += 125 {
		var ops []clientv3.Op
		for j := i; j < i+125; j++ {
			ops = append(ops, clientv3.OpPut(fmt.Sprintf("%sbulk/10.99.0.0-16/10.99.%d.%d", etcdstore.AllIPsPrefix(), j/256, j%256), val))
		}
		_, err := h.cli.Txn(context.Background()).Then(ops...).Commit()
		require.NoError(t, err)
	}
	_, _, errs := h.run("block", "list", "--progress", "always")
	require.Contains(t, errs, "kvipamctl: scanned 10000 keys")
	_, _, errs = h.run("block", "list", "--page-size", "3000")
	require.NotContains(t, errs, "scanned", "auto: no progress when stderr is no terminal")
}

// TestNodeRemoveNeedsEvidence: a node whose lease expired (here revoked,
// as after a partition from etcd longer than its TTL) looks exactly like a
// dead one, so node remove frees its blocks only on the operator's
// positive statement that the node is gone, which etcd must not
// contradict. And when the node does come back after another node took the
// freed block, it does not take the block or the address back.
func TestNodeRemoveNeedsEvidence(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	held := n1.Allocate(t, "small", 0, 5, false)
	n1.Kill(t) // its node record and claim go; its pods may still run
	lastSeen := time.Now().UTC().Format(time.RFC3339Nano)
	unchanged := func() {
		t.Helper()
		require.Equal(t, int64(5), h.count(etcdstore.IPsPrefix("small")), "nothing was released")
		require.Equal(t, int64(1), h.count(etcdstore.HomesPrefix("small")))
	}

	// "No node record" alone is not evidence.
	for _, dry := range [][]string{nil, {"--dry-run"}} {
		code, _, errs := h.run(append([]string{"node", "remove", "n1"}, dry...)...)
		require.Equal(t, exitError, code)
		require.Contains(t, errs, "lease TTL", "the refusal says why a missing record is no proof")
		require.Contains(t, errs, "--confirm-gone n1 --last-seen")
		unchanged()
	}
	// Half the evidence is none.
	code, _, errs := h.run("node", "remove", "n1", "--confirm-gone", "n1")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "--last-seen")
	unchanged()
	// The evidence must name the node being removed.
	code, _, errs = h.run("node", "remove", "n1", "--confirm-gone", "n2", "--last-seen", lastSeen)
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "n2")
	unchanged()
	// An hour ago is before n1 wrote its allocations: etcd knows better.
	code, _, errs = h.run("node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", "1h")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "alive after")
	require.Contains(t, errs, etcdstore.IPKey("small", held[4].Block, held[4].Addr), "names the newest evidence")
	unchanged()

	// Correct evidence: a dry run shows it, the run records it.
	var rep planReport
	require.Equal(t, exitOK, h.json(&rep, "node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", lastSeen, "--dry-run"))
	require.Len(t, rep.Plan.Steps, 6, "5 addresses and 1 home")
	unchanged()
	code, out, errs := h.run("node", "remove", "n1", "--confirm-gone", "n1", "--last-seen", lastSeen, "-o", "json")
	require.Equal(t, exitOK, code, errs)
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, 6, rep.Result.Deleted)
	require.Contains(t, errs, "confirmGone=n1", "the audit trail records the evidence")
	require.Contains(t, errs, "lastSeen=")
	require.Contains(t, errs, "operator=tester")
	require.Zero(t, h.count(etcdstore.IPsPrefix("small")))

	// n2 takes the freed block and n1's first address for its own pod.
	n2 := h.agent("n2")
	res, err := n2.Alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: agenttest.Owner(100), IPs: []netip.Addr{held[0].Addr}})
	require.NoError(t, err)
	require.Equal(t, held[0].Addr, res.Allocations[0].Addr)
	ipKey := etcdstore.IPKey("small", held[0].Block, held[0].Addr)
	before, err := h.cli.Get(context.Background(), ipKey)
	require.NoError(t, err)
	require.Len(t, before.Kvs, 1)

	// n1 comes back (a restore on a new lease, as after the partition):
	// it neither re-claims the block nor touches n2's address.
	n1b := h.agent("n1")
	require.Empty(t, n1b.Alloc.Lookup(agenttest.Owner(0)), "n1's old owner holds nothing now")
	claim, err := h.cli.Get(context.Background(), etcdstore.ClaimKey("small", held[0].Block))
	require.NoError(t, err)
	require.Len(t, claim.Kvs, 1)
	require.Contains(t, string(claim.Kvs[0].Value), `"node":"n2"`)
	after, err := h.cli.Get(context.Background(), ipKey)
	require.NoError(t, err)
	require.Len(t, after.Kvs, 1)
	require.Equal(t, before.Kvs[0].ModRevision, after.Kvs[0].ModRevision, "n2's allocation key is never re-written")
	require.Contains(t, string(after.Kvs[0].Value), agenttest.Owner(100).ContainerID)
	again := n1b.Allocate(t, "small", 0, 1, false)
	require.NotEqual(t, held[0].Block, again[0].Block, "n1 goes on in another block")
	var r inspect.Report
	require.Equal(t, exitOK, h.json(&r, "check"), "%+v", r.Findings)
}

// TestPoolBindings: bind-namespace stores a namespace's default pool
// (refused for a pool etcd does not have), bindings lists them, and
// unbind-namespace removes one.
func TestPoolBindings(t *testing.T) {
	h := newHarness(t)
	h.withSmallPool()
	require.Contains(t, h.ok("pool", "bind-namespace", "team", "small"), "namespace team: pool small")
	code, _, errs := h.run("pool", "bind-namespace", "team", "nope")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "pool not found")
	var rows []struct {
		Namespace string `json:"namespace"`
		Pool      string `json:"pool"`
	}
	require.Equal(t, exitOK, h.json(&rows, "pool", "bindings"))
	require.Len(t, rows, 1)
	require.Equal(t, "team", rows[0].Namespace)
	require.Equal(t, "small", rows[0].Pool)
	require.Contains(t, h.ok("pool", "unbind-namespace", "team"), "no default pool")
	require.Equal(t, exitOK, h.json(&rows, "pool", "bindings"))
	require.Empty(t, rows)
}
