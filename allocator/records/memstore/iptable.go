package memstore

import "net/netip"

// ipTable holds the allocations by block, so that a block's emptiness
// (a claim's compare) and its listing cost the block, not the store.
type ipTable map[blockKey]map[netip.Addr]entry

func (t ipTable) get(k ipKey) (entry, bool) {
	e, ok := t[blockKey{k.pool, k.block}][k.addr]
	return e, ok
}

// rev is the allocation's mod revision, 0 when absent.
func (t ipTable) rev(k ipKey) int64 {
	e, _ := t.get(k)
	return e.rev
}

func (t ipTable) put(b *batch, k ipKey, v any, lease int64) {
	bk := blockKey{k.pool, k.block}
	m := t[bk]
	if m == nil {
		m = map[netip.Addr]entry{}
		t[bk] = m
	}
	b.changed = true
	m[k.addr] = entry{val: enc(v), rev: b.s.rev + 1, lease: lease}
}

func (t ipTable) del(b *batch, k ipKey) {
	bk := blockKey{k.pool, k.block}
	if _, ok := t[bk][k.addr]; !ok {
		return
	}
	b.changed = true
	delete(t[bk], k.addr)
	if len(t[bk]) == 0 {
		delete(t, bk)
	}
}

// keys are the allocations of one block, or of every block of a pool
// (block invalid), in etcd's key order.
func (t ipTable) keys(pool string, block netip.Prefix) []ipKey {
	var out []ipKey
	for bk, m := range t {
		if bk.pool != pool || (block.IsValid() && bk.block != block.Masked()) {
			continue
		}
		for a := range m {
			out = append(out, ipKey{pool, bk.block, a})
		}
	}
	sortIPKeys(out)
	return out
}

// dropLease deletes the allocations on lease id.
func (t ipTable) dropLease(b *batch, id int64) {
	for bk, m := range t {
		for a, e := range m {
			if e.lease == id {
				t.del(b, ipKey{bk.pool, bk.block, a})
			}
		}
	}
}
