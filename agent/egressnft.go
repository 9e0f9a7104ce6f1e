package agent

import (
	"bytes"
	"errors"
	"fmt"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/allocator"
)

// The node's masquerade rules, in nftables, through
// github.com/google/nftables: netlink from Go, as the rest of the
// datapath is (vishvananda/netlink, cilium/ebpf). No iptables or nft
// binary need be in the image, nothing parses a command's output, the
// whole change is one netlink transaction (the kernel applies it all or
// none), and a namespace is reached by its file descriptor, which is how
// the agent programs a node it does not run in (Config.NetNS).
//
// Everything is in one table of kvipam's own, so nothing else's rules
// are read or touched:
//
//	table inet kvipam {
//		set masq_src_v4 { type ipv4_addr; flags interval; }    # masquerading pools' CIDRs
//		set no_masq_dst_v4 { type ipv4_addr; flags interval; } # every pool's CIDRs, egress.nonMasqueradeCIDRs
//		set masq_src_v6, no_masq_dst_v6: the same for IPv6
//		chain postrouting {
//			type nat hook postrouting priority srcnat; policy accept;
//			meta nfproto ipv4 ip saddr @masq_src_v4 ip daddr != @no_masq_dst_v4 counter masquerade
//			meta nfproto ipv6 ip6 saddr @masq_src_v6 ip6 daddr != @no_masq_dst_v6 counter masquerade
//		}
//	}
//
// The rules never change once made; a change of pools rewrites the sets'
// elements in place (flushed and filled in one transaction, so no packet
// sees a half-written set). With no masquerading pool the table goes.

// egressTable is the name of kvipam's table (family inet).
const egressTable = "kvipam"

const (
	egressChain = "postrouting"
	setSrcV4    = "masq_src_v4"
	setSrcV6    = "masq_src_v6"
	setKeepV4   = "no_masq_dst_v4"
	setKeepV6   = "no_masq_dst_v6"
)

// egressRuleTags mark the two rules, in order, as this version makes
// them (rule user data): a table whose rules lack them is made again.
var egressRuleTags = [][]byte{[]byte("kvipam egress v1 ipv4"), []byte("kvipam egress v1 ipv6")}

// nftMasquerader programs the masquerade rules of one network namespace
// (a path such as /proc/1/ns/net; empty: the agent's own). It is not
// safe for concurrent use: one sync loop owns it.
type nftMasquerader struct {
	netns string
}

var _ masquerader = nftMasquerader{}

// program makes kvipam's table say plan, or removes it when plan is
// empty. It changes nothing when the kernel already says plan (an agent
// restart) and reports whether it changed anything.
func (m nftMasquerader) program(plan egressPlan) (changed bool, err error) {
	c, done, err := m.conn()
	if err != nil {
		return false, err
	}
	defer done()
	table, err := findEgressTable(c)
	if err != nil {
		return false, err
	}
	if plan.empty() {
		if table == nil {
			return false, nil
		}
		c.DelTable(table)
		if err := c.Flush(); err != nil {
			return false, fmt.Errorf("remove nftables table inet %s: %w", egressTable, err)
		}
		return true, nil
	}
	want := egressSets(plan)
	if table != nil {
		stale, ok, err := staleSets(c, table, want)
		if err != nil {
			return false, err
		}
		if ok {
			if len(stale) == 0 {
				return false, nil
			}
			for _, s := range stale {
				set := &nftables.Set{Table: table, Name: s.name, KeyType: s.keyType, Interval: true}
				c.FlushSet(set)
				if err := c.SetAddElements(set, s.elems); err != nil {
					return false, fmt.Errorf("set %s: %w", s.name, err)
				}
			}
			if err := c.Flush(); err != nil {
				return false, fmt.Errorf("update nftables sets of table inet %s: %w", egressTable, err)
			}
			return true, nil
		}
		c.DelTable(table) // not as this version makes it: made again, in the same transaction
	}
	if err := buildEgressTable(c, want); err != nil {
		return false, err
	}
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("create nftables table inet %s: %w", egressTable, err)
	}
	return true, nil
}

// RemoveEgress removes kvipam's masquerade table from the network
// namespace at path (empty: the caller's own), if it is there: what
// uninstalling kvipam does (kvipam-agent uninstall-cni). It reports
// whether there was one.
func RemoveEgress(path string) (bool, error) {
	return nftMasquerader{netns: path}.program(egressPlan{})
}

// conn is a netlink connection to nftables in m's namespace, and what
// releases it.
func (m nftMasquerader) conn() (*nftables.Conn, func(), error) {
	if m.netns == "" {
		c, err := nftables.New()
		if err != nil {
			return nil, nil, fmt.Errorf("open nftables: %w", err)
		}
		return c, func() {}, nil
	}
	ns, err := netns.GetFromPath(m.netns)
	if err != nil {
		return nil, nil, fmt.Errorf("open netns %s: %w", m.netns, err)
	}
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		ns.Close()
		return nil, nil, fmt.Errorf("open nftables in %s: %w", m.netns, err)
	}
	return c, func() { ns.Close() }, nil
}

func findEgressTable(c *nftables.Conn) (*nftables.Table, error) {
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("list nftables tables: %w", err)
	}
	for _, t := range tables {
		if t.Name == egressTable {
			return t, nil
		}
	}
	return nil, nil
}

// egressSet is one of the table's sets as plan wants it.
type egressSet struct {
	name    string
	keyType nftables.SetDatatype
	elems   []nftables.SetElement
}

func egressSets(plan egressPlan) []egressSet {
	return []egressSet{
		{setSrcV4, nftables.TypeIPAddr, intervalElements(plan.srcV4, 4)},
		{setKeepV4, nftables.TypeIPAddr, intervalElements(plan.keepV4, 4)},
		{setSrcV6, nftables.TypeIP6Addr, intervalElements(plan.srcV6, 16)},
		{setKeepV6, nftables.TypeIP6Addr, intervalElements(plan.keepV6, 16)},
	}
}

// intervalElements are the elements of an interval set of addresses of
// size bytes holding rs (sorted, disjoint, not adjacent), as nft writes
// them: each range its first address and, flagged as an interval end,
// the address after its last (none past the family's last address),
// after an interval end at the zero address when the first range does
// not start there.
func intervalElements(rs []allocator.AddrRange, size int) []nftables.SetElement {
	var out []nftables.SetElement
	if len(rs) > 0 && !rs[0].First.IsUnspecified() {
		out = append(out, nftables.SetElement{Key: make([]byte, size), IntervalEnd: true})
	}
	for _, r := range rs {
		out = append(out, nftables.SetElement{Key: r.First.AsSlice()})
		if end := r.Last.Next(); end.IsValid() {
			out = append(out, nftables.SetElement{Key: end.AsSlice(), IntervalEnd: true})
		}
	}
	return out
}

// staleSets compares the kernel's table with want: ok is false when the
// table is not as this version makes it (a set or a rule missing or
// different), and stale lists the sets whose elements differ.
func staleSets(c *nftables.Conn, table *nftables.Table, want []egressSet) (stale []egressSet, ok bool, err error) {
	rules, err := c.GetRules(table, &nftables.Chain{Name: egressChain, Table: table})
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("list rules of table inet %s: %w", egressTable, err)
	}
	if len(rules) != len(egressRuleTags) {
		return nil, false, nil
	}
	for i, r := range rules {
		if !bytes.Equal(r.UserData, egressRuleTags[i]) {
			return nil, false, nil
		}
	}
	sets, err := c.GetSets(table)
	if err != nil {
		return nil, false, fmt.Errorf("list sets of table inet %s: %w", egressTable, err)
	}
	for _, w := range want {
		i := slices.IndexFunc(sets, func(s *nftables.Set) bool { return s.Name == w.name })
		if i < 0 || !sets[i].Interval || sets[i].KeyType.Name != w.keyType.Name {
			return nil, false, nil
		}
		have, err := c.GetSetElements(sets[i])
		if err != nil {
			return nil, false, fmt.Errorf("list set %s: %w", w.name, err)
		}
		if !sameElements(have, w.elems) {
			stale = append(stale, w)
		}
	}
	return stale, true, nil
}

// sameElements compares two interval sets' elements, in any order.
func sameElements(a, b []nftables.SetElement) bool {
	key := func(es []nftables.SetElement) []string {
		out := make([]string, len(es))
		for i, e := range es {
			out[i] = fmt.Sprintf("%x/%v", e.Key, e.IntervalEnd)
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(key(a), key(b))
}

// buildEgressTable queues the whole table on c (Flush sends it).
func buildEgressTable(c *nftables.Conn, want []egressSet) error {
	table := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: egressTable})
	sets := map[string]*nftables.Set{}
	for i, w := range want {
		// An ID of our own, unique in the transaction: left 0,
		// google/nftables takes one from a package-wide counter that it
		// does not guard across connections (agents of one process race).
		s := &nftables.Set{Table: table, Name: w.name, ID: uint32(i + 1), KeyType: w.keyType, Interval: true}
		if err := c.AddSet(s, w.elems); err != nil {
			return fmt.Errorf("set %s: %w", w.name, err)
		}
		sets[w.name] = s
	}
	accept := nftables.ChainPolicyAccept
	chain := c.AddChain(&nftables.Chain{
		Name: egressChain, Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept,
	})
	for i, fam := range []struct {
		proto        byte
		saddr, daddr uint32 // offsets in the network header
		size         uint32
		src, keep    *nftables.Set
	}{
		{unix.NFPROTO_IPV4, 12, 16, 4, sets[setSrcV4], sets[setKeepV4]},
		{unix.NFPROTO_IPV6, 8, 24, 16, sets[setSrcV6], sets[setKeepV6]},
	} {
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, UserData: egressRuleTags[i], Exprs: []expr.Any{
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{fam.proto}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: fam.saddr, Len: fam.size},
			&expr.Lookup{SourceRegister: 1, SetName: fam.src.Name, SetID: fam.src.ID},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: fam.daddr, Len: fam.size},
			&expr.Lookup{SourceRegister: 1, SetName: fam.keep.Name, SetID: fam.keep.ID, Invert: true},
			&expr.Counter{},
			&expr.Masq{},
		}})
	}
	return nil
}
