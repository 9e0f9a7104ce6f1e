package etcdstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestDifferential drives etcdstore and the in-memory store with the
// same random steps, each side deciding from its own reads, and requires
// the same answer from both at every step and the same pool after it:
// revisions counted from the start, leases by order of appearance.
// KVIPAM_DIFF_SEED and KVIPAM_DIFF_STEPS choose another run.
func TestDifferential(t *testing.T) {
	seed, steps := uint64(1), 300
	if v, err := strconv.ParseUint(os.Getenv("KVIPAM_DIFF_SEED"), 10, 64); err == nil {
		seed = v
	}
	if v, err := strconv.Atoi(os.Getenv("KVIPAM_DIFF_STEPS")); err == nil {
		steps = v
	}
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	mem := memstore.New(memstore.Options{})
	sides := []*side{
		{name: "etcd", st: etcdstore.New(cli, etcdstore.Options{}),
			grant: func(d time.Duration) int64 {
				r, err := cli.Grant(ctx, int64(d/time.Second))
				require.NoError(t, err)
				return int64(r.ID)
			},
			revoke: func(id int64) { _, _ = cli.Revoke(ctx, clientv3.LeaseID(id)) }},
		{name: "mem", st: mem, grant: mem.Grant, revoke: mem.Revoke},
	}
	pool := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/26")}, BlockSizeV4: 28}
	for _, s := range sides {
		p, err := s.st.EnsurePool(ctx, pool)
		require.NoError(t, err)
		s.base = p.Rev
		s.leases, s.fences, s.ids = map[string]int64{}, map[string]int64{}, map[int64]int{}
	}
	rng := rand.New(rand.NewPCG(seed, 0))
	blocks := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/28"), netip.MustParsePrefix("10.0.0.16/28"), netip.MustParsePrefix("10.0.0.32/28"), netip.MustParsePrefix("10.0.0.48/28")}
	nodes := []string{"n0", "n1", "n2"}
	var log []string
	tally := map[string]int{}
	for step := range steps {
		node, b := nodes[rng.IntN(len(nodes))], blocks[rng.IntN(len(blocks))]
		a := b.Addr()
		for range rng.IntN(16) {
			a = a.Next()
		}
		op := stepOps[rng.IntN(len(stepOps))]
		arg := stepArg{node: node, block: b, addr: a, flag: rng.IntN(4) == 0, owner: rng.IntN(3)}
		log = append(log, fmt.Sprintf("%d %s %+v", step, op.name, arg))
		var got [2]string
		for i, s := range sides {
			got[i] = op.run(ctx, s, arg)
			if i == 0 {
				outcome := got[i]
				if _, e, ok := strings.Cut(outcome, " "); ok {
					outcome = e // the answer without its revision
				}
				outcome, _, _ = strings.Cut(outcome, "(") // its kind
				tally[op.name+": "+outcome]++
			}
			got[i] += " | " + s.state(ctx, t, "p", blocks)
		}
		if got[0] != got[1] {
			t.Fatalf("seed %d: the stores differ after:\n%s\netcd: %s\nmem:  %s", seed, strings.Join(log[max(0, len(log)-15):], "\n"), got[0], got[1])
		}
	}
	var lines []string
	for k, n := range tally {
		lines = append(lines, fmt.Sprintf("%5d %s", n, k))
	}
	sort.Strings(lines)
	t.Logf("seed %d, %d steps, outcomes:\n%s", seed, steps, strings.Join(lines, "\n"))
}

// side is one store under the differential test and what it knows.
type side struct {
	name   string
	st     records.Store
	grant  func(time.Duration) int64
	revoke func(int64)
	base   int64
	leases map[string]int64 // each node's lease
	fences map[string]int64 // each node's borrow fence revision
	ids    map[int64]int    // lease IDs by order of appearance
}

func (s *side) rev(r int64) string {
	if r == 0 {
		return "0"
	}
	return fmt.Sprintf("r%d", r-s.base)
}

func (s *side) lease(id int64) string {
	if id == 0 {
		return "-"
	}
	n, ok := s.ids[id]
	if !ok {
		n = len(s.ids) + 1
		s.ids[id] = n
	}
	return fmt.Sprintf("L%d", n)
}

// errText is an error as the two stores must agree on it.
func (s *side) errText(err error) string {
	var ce *records.ClaimError
	var we *records.WriteError
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &ce):
		return fmt.Sprintf("claim(by=%s empty=%t home=%s rev=%s lease=%s pool=%t)", ce.ClaimedBy, !ce.NonEmpty, ce.HomeNode, s.rev(ce.ClaimRev), s.lease(ce.ClaimLease), ce.PoolChanged)
	case errors.As(err, &we):
		return fmt.Sprintf("write(%v %v %t)", we.Fenced, we.Taken, we.FenceLost)
	}
	for _, e := range []error{records.ErrLeaseLost, records.ErrNotOwned, records.ErrBadRequest, retry.ErrConflict, retry.ErrUnavailable} {
		if errors.Is(err, e) {
			return e.Error()
		}
	}
	return "error"
}

// state is the pool as the side holds it, normalized.
func (s *side) state(ctx context.Context, t *testing.T, pool string, blocks []netip.Prefix) string {
	snap, err := s.st.PoolSnapshot(ctx, pool)
	require.NoError(t, err)
	var out []string
	out = append(out, "rev "+s.rev(snap.Rev))
	for _, bi := range snap.Blocks {
		c := "none"
		if bi.Claim != nil {
			c = fmt.Sprintf("%s@%s/%s", bi.Claim.Node, s.rev(bi.ClaimRev), s.lease(bi.ClaimLease))
		}
		h := "none"
		if bi.Home != nil {
			h = fmt.Sprintf("%s@%s", bi.Home.Node, s.rev(bi.HomeRev))
		}
		out = append(out, fmt.Sprintf("%s claim %s home %s", bi.Block, c, h))
	}
	for _, b := range blocks {
		als, err := s.st.ListIPs(ctx, pool, b)
		require.NoError(t, err)
		for _, al := range als {
			out = append(out, fmt.Sprintf("%s %s/%s %s %s %s borrowed=%t id=%s", al.Addr, al.ContainerID, al.Pod, al.Node, al.State, s.rev(al.Rev)+"/"+s.lease(al.Lease), al.Borrowed, al.Identity))
		}
	}
	var lent []string
	for a, n := range snap.Lent {
		lent = append(lent, a.String()+"="+n)
	}
	sort.Strings(lent)
	out = append(out, "lent "+strings.Join(lent, ","))
	bs, err := s.st.ListBindings(ctx, pool)
	require.NoError(t, err)
	for _, b := range bs {
		out = append(out, fmt.Sprintf("binding %s %v %s %s %s/%s", b.Identity, b.Addrs, b.Owner.ContainerID, b.Node, s.rev(b.Rev), s.lease(b.Lease)))
	}
	return strings.Join(out, "; ")
}

type stepArg struct {
	node  string
	block netip.Prefix
	addr  netip.Addr
	flag  bool
	owner int
}

type stepOp struct {
	name string
	run  func(ctx context.Context, s *side, a stepArg) string
}

var since = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func diffRecord(a stepArg, st records.State) records.Record {
	return records.Record{Owner: records.Owner{ContainerID: fmt.Sprintf("c%d", a.owner), IfName: "eth0", Pod: fmt.Sprintf("pod%d", a.owner)}, Node: a.node, State: st, Since: since}
}

// block reads b's claim and home as the side holds them.
func (s *side) block(ctx context.Context, b netip.Prefix) records.BlockInfo {
	got, _ := s.st.GetBlocks(ctx, "p", []netip.Prefix{b})
	if bi, ok := got[b]; ok {
		return bi
	}
	return records.BlockInfo{Block: b}
}

func (s *side) ip(ctx context.Context, b netip.Prefix, a netip.Addr) (records.Allocation, bool) {
	got, _ := s.st.GetIPs(ctx, []records.IPRef{{Pool: "p", Block: b, Addr: a}})
	al, ok := got[a]
	return al, ok
}

const diffIdentity = "ns/web-0"

var stepOps = []stepOp{
	{"restart", func(_ context.Context, s *side, a stepArg) string {
		s.leases[a.node] = s.grant(time.Minute)
		return s.lease(s.leases[a.node]) + " ok"
	}},
	{"expire", func(_ context.Context, s *side, a stepArg) string {
		s.revoke(s.leases[a.node])
		return "ok"
	}},
	{"claim", func(ctx context.Context, s *side, a stepArg) string {
		c := records.Claim{Node: a.node, ClaimedAt: since}
		if a.flag {
			c.First = &records.IPWrite{Pool: "p", Block: a.block, Addr: a.addr, Record: diffRecord(a, records.StateReserved), Reserve: true}
		}
		res, err := s.st.Claim(ctx, "p", a.block, c, s.leases[a.node])
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"claim", func(ctx context.Context, s *side, a stepArg) string {
		res, err := s.st.Claim(ctx, "p", a.block, records.Claim{Node: a.node, ClaimedAt: since}, s.leases[a.node])
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"reclaim", func(ctx context.Context, s *side, a stepArg) string {
		rev, err := s.st.Reclaim(ctx, "p", s.block(ctx, a.block), records.Claim{Node: a.node, ClaimedAt: since}, s.leases[a.node])
		return s.rev(rev) + " " + s.errText(err)
	}},
	{"unclaim", func(ctx context.Context, s *side, a stepArg) string {
		return s.errText(s.st.Unclaim(ctx, "p", a.block, s.block(ctx, a.block).ClaimRev))
	}},
	{"write", func(ctx context.Context, s *side, a stepArg) string {
		fence := s.block(ctx, a.block).ClaimRev
		if fence == 0 && !a.flag {
			// Mostly into claimed blocks: ClaimRev 0 compares "no
			// claim", and such writes would fill every block.
			return "unclaimed"
		}
		st := records.StateAllocated
		if a.owner == 0 {
			st = records.StateReserved
		}
		res, err := s.st.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: a.block, ClaimRev: fence, Addr: a.addr, Record: diffRecord(a, st), Reserve: st == records.StateReserved}})
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"write", func(ctx context.Context, s *side, a stepArg) string {
		// Two addresses of a block, one fence.
		fence := s.block(ctx, a.block).ClaimRev
		if fence == 0 {
			return "unclaimed"
		}
		other := a.block.Addr()
		res, err := s.st.WriteIPs(ctx, []records.IPWrite{
			{Pool: "p", Block: a.block, ClaimRev: fence, Addr: a.addr, Record: diffRecord(a, records.StateReserved), Reserve: true},
			{Pool: "p", Block: a.block, ClaimRev: fence, Addr: other, Record: diffRecord(a, records.StateAllocated)},
		})
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"confirm", func(ctx context.Context, s *side, a stepArg) string {
		al, ok := s.ip(ctx, a.block, a.addr)
		if !ok {
			return "absent"
		}
		rec := al.Record
		rec.State = records.StateAllocated
		w := records.IPWrite{Pool: "p", Block: a.block, ClaimRev: s.block(ctx, a.block).ClaimRev, Addr: a.addr, Record: rec, PrevRev: al.Rev}
		if al.Borrowed {
			w.Borrowed, w.ClaimRev = true, s.fences[al.Node]
		}
		res, err := s.st.WriteIPs(ctx, []records.IPWrite{w})
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"delete", func(ctx context.Context, s *side, a stepArg) string {
		al, ok := s.ip(ctx, a.block, a.addr)
		if !ok {
			return "absent"
		}
		if a.flag {
			al.Rev-- // stale
		}
		return s.errText(s.st.DeleteIP(ctx, al))
	}},
	{"clear", func(ctx context.Context, s *side, a stepArg) string {
		// Release everything in the block, as GC would.
		als, err := s.st.ListIPs(ctx, "p", a.block)
		if err != nil {
			return s.errText(err)
		}
		out := "ok"
		for _, al := range als {
			out += " " + s.errText(s.st.DeleteIP(ctx, al))
		}
		return out
	}},
	{"lapse", func(ctx context.Context, s *side, a stepArg) string {
		al, ok := s.ip(ctx, a.block, a.addr)
		if !ok || al.Lease == 0 {
			return "none"
		}
		s.revoke(al.Lease)
		return s.lease(al.Lease) + " ok"
	}},
	{"fence", func(ctx context.Context, s *side, a stepArg) string {
		rev, err := s.st.FenceBorrower(ctx, records.Claim{Node: a.node}, s.leases[a.node])
		if err == nil {
			s.fences[a.node] = rev
		}
		return s.rev(rev) + " " + s.errText(err)
	}},
	{"borrow", func(ctx context.Context, s *side, a stepArg) string {
		rec := diffRecord(a, records.StateAllocated)
		rec.Borrowed = true
		res, err := s.st.WriteIPs(ctx, []records.IPWrite{{Pool: "p", Block: a.block, ClaimRev: s.fences[a.node], Addr: a.addr, Record: rec, Borrowed: true, Reserve: a.flag}})
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"bind", func(ctx context.Context, s *side, a stepArg) string {
		cur, _, err := s.st.GetBinding(ctx, "p", diffIdentity)
		if err != nil {
			return s.errText(err)
		}
		rec := diffRecord(a, records.StateReserved)
		rec.Identity = diffIdentity
		b := records.Binding{Pool: "p", Identity: diffIdentity, Addrs: []netip.Addr{a.addr}, Owner: rec.Owner, Node: a.node, Since: since, WindowSeconds: 60, Rev: cur.Rev}
		w := records.IPWrite{Pool: "p", Block: a.block, ClaimRev: s.block(ctx, a.block).ClaimRev, Addr: a.addr, Record: rec, Reserve: true}
		if al, ok := s.ip(ctx, a.block, a.addr); ok && al.State == records.StateKept {
			w.PrevRev = al.Rev // a takeover
		}
		res, err := s.st.WriteBound(ctx, b, []records.IPWrite{w})
		return s.rev(res.Rev) + " " + s.errText(err)
	}},
	{"keep", func(ctx context.Context, s *side, a stepArg) string {
		b, ok, err := s.st.GetBinding(ctx, "p", diffIdentity)
		if err != nil || !ok || b.Kept() {
			return "none"
		}
		var als []records.Allocation
		for _, addr := range b.Addrs {
			blk := netip.PrefixFrom(addr, 28).Masked()
			if al, ok := s.ip(ctx, blk, addr); ok && al.Owner.Key() == b.Owner.Key() {
				als = append(als, al)
			}
		}
		_, err = s.st.Keep(ctx, b, als)
		return s.errText(err)
	}},
	{"drop-stale", func(ctx context.Context, s *side, a stepArg) string {
		b, ok, err := s.st.GetBinding(ctx, "p", diffIdentity)
		if err != nil || !ok {
			return "none"
		}
		var refs []records.IPRef
		for _, addr := range b.Addrs {
			refs = append(refs, records.IPRef{Pool: "p", Block: netip.PrefixFrom(addr, 28).Masked(), Addr: addr})
		}
		cur, _ := s.st.GetIPs(ctx, refs)
		return s.errText(s.st.DropStaleBinding(ctx, b, refs, cur))
	}},
}
