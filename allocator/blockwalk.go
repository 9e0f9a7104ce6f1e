package allocator

import (
	"hash/fnv"
	"math"
	"math/bits"
	"net/netip"
)

// walkBudget bounds the blocks one choice looks at in a family too large
// to walk whole (an IPv6 /64 of /120 blocks has 2^56): past it the
// family is reported full for now, and the claim loop reads the claims
// again before it says so for good.
const walkBudget = 1 << 16

// BlockWalk is one node's order of the blocks of one family: the
// permutation i -> (start + i*stride) mod n of the block indexes, with
// start and stride from a hash of the node's name and stride coprime to
// n. Nodes starting at once therefore mostly try different blocks, a
// restarted node prefers the blocks it preferred before, and a choice
// costs the same on a /24 and on a /8: it looks only at the blocks its
// walk passes, from where the last choice stopped, never at every block
// of the pool.
type BlockWalk struct {
	cidrs  []netip.Prefix
	counts []uint64 // blocks per cidr
	bits   int
	n      uint64
	start  uint64
	stride uint64
	pos    uint64 // the walk's step of the last choice
}

// NewBlockWalk walks the blocks of p's CIDRs of family f that are not
// draining (drain.go): no block is claimed in a CIDR being retired.
func NewBlockWalk(node string, p Pool, f Family) *BlockWalk {
	w := &BlockWalk{cidrs: p.ServingCIDRsOf(f), bits: p.BlockSize(f)}
	for _, c := range w.cidrs {
		k := BlockCount(c, w.bits)
		w.counts = append(w.counts, k)
		var carry uint64
		if w.n, carry = bits.Add64(w.n, k, 0); carry != 0 {
			w.n = math.MaxUint64
		}
	}
	if w.n == 0 {
		return w
	}
	w.start = nodeHash(node, "start") % w.n
	w.stride = nodeHash(node, "stride") % w.n
	if w.stride == 0 {
		w.stride = 1
	}
	for gcd(w.stride, w.n) != 1 {
		w.stride = w.stride%(w.n-1) + 1 // stays in [1, n): n > 1 here
	}
	return w
}

// at is the block at step i of the walk.
func (w *BlockWalk) at(i uint64) (netip.Prefix, bool) {
	hi, lo := bits.Mul64(i, w.stride)
	_, g := bits.Div64(hi, lo, w.n) // hi < n, since i and stride are below n
	g, carry := bits.Add64(g, w.start, 0)
	if carry != 0 || g >= w.n {
		g -= w.n
	}
	for k, c := range w.cidrs {
		if g < w.counts[k] {
			b, err := BlockAt(c, w.bits, g)
			return b, err == nil
		}
		g -= w.counts[k]
	}
	return netip.Prefix{}, false
}

// next returns the first block from the walk's position on for which
// taken is false, and stays there: the next call looks at it first (a
// claim that lost its race marks it taken, one that won makes it own).
// It gives up after a whole cycle, or walkBudget blocks.
func (w *BlockWalk) Next(taken func(netip.Prefix) bool) (netip.Prefix, bool) {
	for range min(w.n, walkBudget) {
		if b, ok := w.at(w.pos); ok && !taken(b) {
			return b, true
		}
		w.pos++
		if w.pos == w.n {
			w.pos = 0
		}
	}
	return netip.Prefix{}, false
}

// Upcoming lists up to k blocks that Next would return from here on, in
// order, if each one before were taken: the walk's next candidates. It
// does not move the walk, and looks at no more blocks than Next would.
func (w *BlockWalk) Upcoming(k int, taken func(netip.Prefix) bool) []netip.Prefix {
	var out []netip.Prefix
	pos := w.pos
	for range min(w.n, walkBudget) {
		if len(out) >= k {
			break
		}
		if b, ok := w.at(pos); ok && !taken(b) {
			out = append(out, b)
		}
		if pos++; pos == w.n {
			pos = 0
		}
	}
	return out
}

// nodeHash is FNV-1a of the node's name and what, finished with
// splitmix64's mixer: FNV-1a's low bits, which a modulo by a power of two
// keeps, depend only on the low bits of its state, so names that differ
// in a digit or two (node-00017, node-00018) land on the same block far
// more often than at random (3,840 distinct first blocks of 16,384 for
// 5,000 such names, against about 4,310 at random). The mixer spreads
// every bit over all of them.
func nodeHash(node, what string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(node))
	h.Write([]byte{0})
	h.Write([]byte(what))
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// Bits is the block size (prefix length) the walk hands out.
func (w *BlockWalk) Bits() int { return w.bits }
