// Package adopt decides how another IPAM's live allocations become
// kvipam records (kvipamctl import): the sources' shapes (host-local's
// files, whereabouts' objects, in subpackages) are read into Allocations,
// and Plan turns them, with what kvipam holds, into one write per block
// (records.ImportBlock). Plan is pure: it does no I/O; cmd/kvipamctl
// reads the state, and allocator/etcdstore writes the plan.
package adopt

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Allocation is one live allocation of a source: an address, the
// attachment that holds it, and the node its pod runs on.
type Allocation struct {
	Addr  netip.Addr    `json:"ip"`
	Owner records.Owner `json:"owner"`
	Node  string        `json:"node"`
}

// Node is a node's live agent as its node record says: the lease the
// import writes the node's claims on, its boot ID.
type Node struct {
	Lease  int64
	BootID string
}

// State is what kvipam holds that the plan decides on, read before it.
type State struct {
	// Pool is the pool imported into, at the revision read.
	Pool allocator.Pool
	// Blocks are the claims and homes of the blocks the source's
	// addresses fall in.
	Blocks map[netip.Prefix]records.BlockInfo
	// Held are kvipam's records at the source's addresses.
	Held map[netip.Addr]records.Allocation
	// Used counts the allocations of each block (records.PoolSnapshot).
	Used map[netip.Prefix]int
	// Nodes are the live agents, by node name.
	Nodes map[string]Node
	// Fences are the borrow fences found, by node.
	Fences map[string]records.BorrowFence
	// Marks are the import marks found.
	Marks []records.ImportMark
	Now   time.Time
}

// Plan is what an import writes, block by block, and what it refuses.
type Plan struct {
	Source string `json:"source"`
	Pool   string `json:"pool"`
	// Writes are the blocks to write, one transaction each.
	Writes []records.ImportBlock `json:"-"`
	// Blocks describe every block of the source, for people.
	Blocks []BlockPlan `json:"blocks"`
	// Refused are the blocks (or addresses) not imported, and why.
	Refused []Refusal `json:"refused,omitempty"`
	// NeedFences are the nodes that hold addresses as borrowed and have
	// no borrow fence on their live lease yet: the driver puts one
	// (records.Loans.FenceBorrower) and plans again.
	NeedFences []string `json:"needFences,omitempty"`
}

// BlockPlan says what happens to one block.
type BlockPlan struct {
	Block    netip.Prefix `json:"block"`
	Claimant string       `json:"claimant,omitempty"`
	// Action: "claim" (take the block), "write" (into the claimant's
	// claim), "done" (imported already), "refused".
	Action   string              `json:"action"`
	New      []Allocation        `json:"new,omitempty"`
	Borrowed map[netip.Addr]bool `json:"borrowed,omitempty"`
	Already  int                 `json:"already,omitempty"`
}

// Refusal is a block, or an address, the import does not write.
type Refusal struct {
	Block netip.Prefix `json:"block,omitempty"`
	Addr  netip.Addr   `json:"ip,omitempty"`
	Err   error        `json:"-"`
	Why   string       `json:"why"`
}

// Make plans the import of allocs from source into st.Pool. network, if
// set, is the CNI network name the records carry (GC of that network then
// sees them).
func Make(source, network string, allocs []Allocation, st State) Plan {
	pl := Plan{Source: source, Pool: st.Pool.Name}
	byBlock := map[netip.Prefix][]Allocation{}
	seen := map[netip.Addr]Allocation{}
	for _, a := range allocs {
		if prev, dup := seen[a.Addr]; dup {
			if prev.Owner.Key() != a.Owner.Key() {
				pl.refuse(netip.Prefix{}, a.Addr, fmt.Errorf("the source gives %s to both %s and %s", a.Addr, prev.Owner.Key(), a.Owner.Key()))
			}
			continue
		}
		seen[a.Addr] = a
		b, ok := st.Pool.BlockFor(a.Addr)
		if !ok {
			pl.refuse(netip.Prefix{}, a.Addr, fmt.Errorf("%s (%s) is in no CIDR of pool %s: add one that covers the source's range", a.Addr, a.Owner.Key(), st.Pool.Name))
			continue
		}
		if a.Owner.Network == "" {
			a.Owner.Network = network
		}
		byBlock[b] = append(byBlock[b], a)
	}
	blocks := make([]netip.Prefix, 0, len(byBlock))
	for b := range byBlock {
		blocks = append(blocks, b)
	}
	slices.SortFunc(blocks, func(x, y netip.Prefix) int { return x.Addr().Compare(y.Addr()) })
	fences := map[string]bool{}
	for _, b := range blocks {
		bp, w, err := planBlock(source, b, byBlock[b], st, fences)
		if err != nil {
			bp.Action = "refused"
			pl.refuse(b, netip.Addr{}, err)
		}
		pl.Blocks = append(pl.Blocks, bp)
		if w != nil {
			pl.Writes = append(pl.Writes, *w)
		}
	}
	for n := range fences {
		pl.NeedFences = append(pl.NeedFences, n)
	}
	slices.Sort(pl.NeedFences)
	if len(pl.NeedFences) > 0 {
		pl.Writes = nil // planned again once the fences are there
	}
	return pl
}

func (pl *Plan) refuse(b netip.Prefix, a netip.Addr, err error) {
	pl.Refused = append(pl.Refused, Refusal{Block: b, Addr: a, Err: err, Why: err.Error()})
}

// planBlock decides one block: who claims it, which addresses are new,
// borrowed or imported already, and refuses the whole block on any
// conflict.
func planBlock(source string, b netip.Prefix, allocs []Allocation, st State, needFence map[string]bool) (BlockPlan, *records.ImportBlock, error) {
	slices.SortFunc(allocs, func(x, y Allocation) int { return x.Addr.Compare(y.Addr) })
	bp := BlockPlan{Block: b}
	count := map[string]int{}
	for _, a := range allocs {
		if _, live := st.Nodes[a.Node]; !live {
			return bp, nil, fmt.Errorf("node %q (of %s at %s) has no live kvipam agent: start the agent there before the import", a.Node, a.Owner.Key(), a.Addr)
		}
		count[a.Node]++
	}
	var news []Allocation
	for _, a := range allocs {
		held, ok := st.Held[a.Addr]
		switch {
		case !ok:
			news = append(news, a)
		case held.Owner.Key() == a.Owner.Key() && held.Node == a.Node:
			bp.Already++
		default:
			return bp, nil, &records.ImportConflictError{Pool: st.Pool.Name, Addr: a.Addr, Held: held, Want: a.Owner, Node: a.Node, Block: b}
		}
	}
	info := st.Blocks[b]
	var claimRev int64
	switch {
	case info.Claim != nil:
		bp.Claimant = info.Claim.Node
		n, live := st.Nodes[bp.Claimant]
		if !live || n.Lease != info.ClaimLease {
			return bp, nil, fmt.Errorf("block %s is claimed by node %s on a lease that is not its live agent's: wait until its agent re-claims it (or kvipamctl node remove)", b, bp.Claimant)
		}
		claimRev = info.ClaimRev
		bp.Action = "write"
	case st.Used[b] > 0:
		home := "none"
		if info.Home != nil {
			home = info.Home.Node
		}
		return bp, nil, fmt.Errorf("block %s is orphaned (no claim, %d allocations in it, home %s): its node's agent re-claims it at start; import again after", b, st.Used[b], home)
	default:
		bp.Claimant = mostAddrs(count)
		bp.Action = "claim"
	}
	bp.New = news
	if len(news) == 0 {
		bp.Action = "done"
		return bp, nil, nil
	}
	w := &records.ImportBlock{Pool: st.Pool.Name, Block: b, Claimant: bp.Claimant, BootID: st.Nodes[bp.Claimant].BootID,
		Lease: st.Nodes[bp.Claimant].Lease, ClaimRev: claimRev, PoolRev: st.Pool.Rev}
	byNode := map[string][]netip.Addr{}
	for _, a := range news {
		rec := records.Record{Owner: a.Owner, Node: a.Node, State: records.StateAllocated, Since: st.Now.UTC(), Imported: source}
		if a.Node != bp.Claimant {
			rec.Borrowed = true
			f, ok := st.Fences[a.Node]
			if !ok || f.Lease != st.Nodes[a.Node].Lease {
				needFence[a.Node] = true
			} else {
				if w.Borrowers == nil {
					w.Borrowers = map[string]records.BorrowFence{}
				}
				w.Borrowers[a.Node] = f
			}
			if bp.Borrowed == nil {
				bp.Borrowed = map[netip.Addr]bool{}
			}
			bp.Borrowed[a.Addr] = true
		}
		w.IPs = append(w.IPs, records.ImportedIP{Addr: a.Addr, Record: rec})
		byNode[a.Node] = append(byNode[a.Node], a.Addr)
	}
	for _, n := range sortedKeys(byNode) {
		m := records.ImportMark{Source: source, Node: n, Pool: st.Pool.Name, Block: b, Borrowed: n != bp.Claimant, At: st.Now.UTC()}
		for _, old := range st.Marks {
			if old.Source == source && old.Node == n && old.Pool == st.Pool.Name && old.Block == b {
				m.Rev, m.Addrs, m.Unknown = old.Rev, slices.Clone(old.Addrs), old.Unknown
			}
		}
		for _, a := range byNode[n] {
			if !slices.Contains(m.Addrs, a) {
				m.Addrs = append(m.Addrs, a)
			}
		}
		slices.SortFunc(m.Addrs, netip.Addr.Compare)
		w.Marks = append(w.Marks, m)
	}
	return bp, w, nil
}

// mostAddrs is the node with the most addresses (the lowest name of a tie):
// it claims a block no node holds; the others borrow in it.
func mostAddrs(count map[string]int) string {
	names := sortedKeys(count)
	slices.SortStableFunc(names, func(x, y string) int { return cmp.Compare(count[y], count[x]) })
	return names[0]
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
