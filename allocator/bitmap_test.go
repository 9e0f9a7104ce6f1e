package allocator_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func TestNewBitmapSize(t *testing.T) {
	tests := []struct {
		in, want int
	}{
		{in: 0, want: 0},
		{in: 1, want: 1},
		{in: 64, want: 64},
		{in: 65, want: 65},
		{in: 65536, want: 65536},
		{in: 65537, want: 65536},
		{in: math.MaxInt, want: 65536},
		{in: -1, want: 0},
		{in: math.MinInt, want: 0},
	}
	for _, tc := range tests {
		t.Run(itoa(tc.in), func(t *testing.T) {
			b := allocator.NewBitmap(tc.in)
			require.Equal(t, tc.want, b.Size())
			require.Zero(t, b.Used())
			// Every index is clear, and the ones around the edges are
			// out of range rather than panicking.
			for _, i := range []int{-1, 0, tc.want - 1, tc.want, tc.want + 1, math.MaxInt, math.MinInt} {
				require.False(t, b.IsSet(i))
			}
			require.False(t, b.Set(tc.want))
			require.False(t, b.Set(-1))
			require.False(t, b.Clear(tc.want))
			_, ok := b.NextClear(0)
			require.Equal(t, tc.want > 0, ok)
		})
	}
}

func TestBitmapSetClear(t *testing.T) {
	b := allocator.NewBitmap(130)
	steps := []struct {
		name    string
		op      func(int) bool
		i       int
		changed bool
		used    int
	}{
		{name: "set 0", op: b.Set, i: 0, changed: true, used: 1},
		{name: "set 0 again", op: b.Set, i: 0, changed: false, used: 1},
		{name: "set 63", op: b.Set, i: 63, changed: true, used: 2},
		{name: "set 64", op: b.Set, i: 64, changed: true, used: 3},
		{name: "set 129", op: b.Set, i: 129, changed: true, used: 4},
		{name: "set 130 out of range", op: b.Set, i: 130, changed: false, used: 4},
		{name: "clear 63", op: b.Clear, i: 63, changed: true, used: 3},
		{name: "clear 63 again", op: b.Clear, i: 63, changed: false, used: 3},
		{name: "clear 5 never set", op: b.Clear, i: 5, changed: false, used: 3},
		{name: "clear -1", op: b.Clear, i: -1, changed: false, used: 3},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			require.Equal(t, s.changed, s.op(s.i))
			require.Equal(t, s.used, b.Used())
		})
	}
	require.True(t, b.IsSet(0))
	require.False(t, b.IsSet(63))
	require.True(t, b.IsSet(64))
	require.True(t, b.IsSet(129))
}

func TestBitmapNextClear(t *testing.T) {
	full := func(size int, except ...int) *allocator.Bitmap {
		b := allocator.NewBitmap(size)
		for i := range size {
			b.Set(i)
		}
		for _, i := range except {
			b.Clear(i)
		}
		return b
	}
	tests := []struct {
		name string
		b    *allocator.Bitmap
		from int
		want int
		ok   bool
	}{
		{name: "empty from 0", b: allocator.NewBitmap(100), from: 0, want: 0, ok: true},
		{name: "empty from 99", b: allocator.NewBitmap(100), from: 99, want: 99, ok: true},
		{name: "from past end wraps", b: allocator.NewBitmap(100), from: 100, want: 0, ok: true},
		{name: "negative from starts at 0", b: allocator.NewBitmap(100), from: -7, want: 0, ok: true},
		{name: "zero size", b: allocator.NewBitmap(0), from: 0},
		{name: "full", b: full(100), from: 3},
		{name: "full, one word", b: full(64), from: 0},
		{name: "full, tail bits of last word not counted", b: full(65), from: 64},
		{name: "one free ahead", b: full(200, 150), from: 10, want: 150, ok: true},
		{name: "one free at from", b: full(200, 150), from: 150, want: 150, ok: true},
		{name: "one free behind wraps", b: full(200, 10), from: 150, want: 10, ok: true},
		{name: "one free in from's word behind from", b: full(200, 129), from: 130, want: 129, ok: true},
		{name: "last index", b: full(130, 129), from: 0, want: 129, ok: true},
		{name: "first index from end", b: full(130, 0), from: 129, want: 0, ok: true},
		{name: "word boundary", b: full(256, 64, 128), from: 65, want: 128, ok: true},
		{name: "size 1 free", b: allocator.NewBitmap(1), from: 0, want: 0, ok: true},
		{name: "size 1 full", b: full(1), from: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.b.NextClear(tc.from)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, tc.want, got)
			}
		})
	}
}

// TestBitmapMatchesNaive runs random operations against a []bool model.
func TestBitmapMatchesNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, size := range []int{1, 63, 64, 65, 127, 128, 129, 1000} {
		t.Run(itoa(size), func(t *testing.T) {
			b := allocator.NewBitmap(size)
			model := make([]bool, size)
			used := 0
			for range 20000 {
				i := r.IntN(size+4) - 2
				switch r.IntN(4) {
				case 0, 1:
					want := i >= 0 && i < size && !model[i]
					if want {
						model[i] = true
						used++
					}
					require.Equal(t, want, b.Set(i))
				case 2:
					want := i >= 0 && i < size && model[i]
					if want {
						model[i] = false
						used--
					}
					require.Equal(t, want, b.Clear(i))
				case 3:
					want, wantOK := -1, false
					start := i
					if start < 0 || start >= size {
						start = 0
					}
					for k := range size {
						if j := (start + k) % size; !model[j] {
							want, wantOK = j, true
							break
						}
					}
					got, ok := b.NextClear(i)
					require.Equal(t, wantOK, ok)
					if ok {
						require.Equal(t, want, got)
					}
				}
				require.Equal(t, used, b.Used())
			}
			for i := range size {
				require.Equal(t, model[i], b.IsSet(i))
			}
		})
	}
}
