package allocator

import "math/bits"

// maxBitmapSize is the largest block a pool allows (see maxBlockHostBits).
const maxBitmapSize = 1 << maxBlockHostBits

// Bitmap is a fixed-size set of small integers, one bit each, with a count of
// set bits. It is the free map of a block: 65536 addresses fit in 8 KiB and
// finding a free one scans 64 addresses per step.
//
// A Bitmap is not safe for concurrent use.
type Bitmap struct {
	words []uint64
	size  int
	used  int
}

// NewBitmap returns an empty Bitmap of size bits. size is clamped to
// [0, 65536], the largest block a pool allows, so a bad size cannot exhaust
// memory; Size reports the result.
func NewBitmap(size int) *Bitmap {
	size = min(max(size, 0), maxBitmapSize)
	return &Bitmap{words: make([]uint64, (size+63)/64), size: size}
}

// Size returns the number of bits.
func (b *Bitmap) Size() int { return b.size }

// Set sets bit i and reports whether it changed; false also when i is out of
// range.
func (b *Bitmap) Set(i int) bool {
	if i < 0 || i >= b.size {
		return false
	}
	w, m := i>>6, uint64(1)<<(i&63)
	if b.words[w]&m != 0 {
		return false
	}
	b.words[w] |= m
	b.used++
	return true
}

// Clear clears bit i and reports whether it changed; false also when i is out
// of range.
func (b *Bitmap) Clear(i int) bool {
	if i < 0 || i >= b.size {
		return false
	}
	w, m := i>>6, uint64(1)<<(i&63)
	if b.words[w]&m == 0 {
		return false
	}
	b.words[w] &^= m
	b.used--
	return true
}

// IsSet reports whether bit i is set; false when i is out of range.
func (b *Bitmap) IsSet(i int) bool {
	if i < 0 || i >= b.size {
		return false
	}
	return b.words[i>>6]&(uint64(1)<<(i&63)) != 0
}

// Used returns the number of set bits. It is a counter, not a scan, so
// callers can ask it on every allocation.
func (b *Bitmap) Used() int { return b.used }

// NextClear returns the first clear index at or after from, wrapping once
// around to 0, so the whole bitmap is searched once. A from outside
// [0, Size) starts at 0. ok is false when every bit is set.
func (b *Bitmap) NextClear(from int) (int, bool) {
	if b.used >= b.size {
		return 0, false
	}
	if from < 0 || from >= b.size {
		from = 0
	}
	if i, ok := b.scan(from, b.size); ok {
		return i, true
	}
	return b.scan(0, from)
}

// scan returns the first clear index in [lo, hi), a word at a time.
func (b *Bitmap) scan(lo, hi int) (int, bool) {
	for lo < hi {
		w := lo >> 6
		free := ^b.words[w] &^ (uint64(1)<<(lo&63) - 1)
		if free != 0 {
			// Bits past hi in this word may be clear (including the unused
			// tail of the last word), so check the found index against hi.
			if i := w<<6 + bits.TrailingZeros64(free); i < hi {
				return i, true
			}
			return 0, false
		}
		lo = (w + 1) << 6
	}
	return 0, false
}

// reset clears every bit.
func (b *Bitmap) reset() {
	clear(b.words)
	b.used = 0
}
