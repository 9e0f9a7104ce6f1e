package allocator_test

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

// newBlockAlloc builds a BlockAlloc for a block of a pool that must be valid.
func newBlockAlloc(tb testing.TB, p allocator.Pool, block string) *allocator.BlockAlloc {
	tb.Helper()
	require.NoError(tb, p.Validate())
	b, err := allocator.NewBlockAlloc(p, pfx(block))
	require.NoError(tb, err)
	return b
}

// drain calls Next and Mark until the block is full and returns the
// addresses in the order handed out.
func drain(tb testing.TB, b *allocator.BlockAlloc) []netip.Addr {
	tb.Helper()
	var out []netip.Addr
	for {
		a, ok := b.Next()
		if !ok {
			return out
		}
		require.True(tb, b.Mark(a), "Next returned %s, which is not free", a)
		out = append(out, a)
	}
}

func TestNewBlockAllocRejects(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120}
	big := allocator.Pool{Name: "big", CIDRs: pfxs("10.0.0.0/8"), BlockSizeV4: 15} // invalid: block too large
	tests := []struct {
		name  string
		pool  allocator.Pool
		block netip.Prefix
	}{
		{name: "wrong size", pool: p, block: pfx("10.0.0.0/25")},
		{name: "outside pool", pool: p, block: pfx("10.0.1.0/26")},
		{name: "host bits", pool: p, block: pfx("10.0.0.1/26")},
		{name: "zero block", pool: p, block: netip.Prefix{}},
		{name: "ipv6 wrong size", pool: p, block: pfx("fd00::/112")},
		{name: "block larger than a bitmap", pool: big, block: pfx("10.0.0.0/15")},
		{name: "empty pool", pool: allocator.Pool{}, block: pfx("10.0.0.0/26")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := allocator.NewBlockAlloc(tc.pool, tc.block)
			require.ErrorIs(t, err, allocator.ErrInvalidBlock)
			require.ErrorContains(t, err, "new block alloc")
			require.Nil(t, b)
		})
	}
}

func TestBlockAllocExcluded(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26}
	tests := []struct {
		block    string
		excluded []string
		first    string // first address Next hands out
		last     string // last address Next hands out
	}{
		{block: "10.0.0.0/26", excluded: []string{"10.0.0.0"}, first: "10.0.0.1", last: "10.0.0.63"},
		{block: "10.0.0.64/26", first: "10.0.0.64", last: "10.0.0.127"},
		{block: "10.0.0.128/26", first: "10.0.0.128", last: "10.0.0.191"},
		{block: "10.0.0.192/26", excluded: []string{"10.0.0.255"}, first: "10.0.0.192", last: "10.0.0.254"},
	}
	for _, tc := range tests {
		t.Run(tc.block, func(t *testing.T) {
			b := newBlockAlloc(t, p, tc.block)
			require.Equal(t, pfx(tc.block), b.Prefix())
			require.Equal(t, 64-len(tc.excluded), b.Capacity())
			require.Equal(t, b.Capacity(), b.Free())
			require.Zero(t, b.Used())
			for _, s := range tc.excluded {
				a := addr(s)
				require.True(t, b.IsUsed(a), "excluded counts as used")
				require.False(t, b.Mark(a), "excluded cannot be marked")
				require.False(t, b.Unmark(a), "excluded cannot be unmarked")
				require.True(t, b.IsUsed(a))
			}
			got := drain(t, b)
			require.Len(t, got, b.Capacity())
			require.Equal(t, addr(tc.first), got[0])
			require.Equal(t, addr(tc.last), got[len(got)-1])
			for _, s := range tc.excluded {
				require.NotContains(t, got, addr(s))
			}
			require.Zero(t, b.Free())
			require.Equal(t, b.Capacity(), b.Used())

			b.Reset()
			require.Equal(t, b.Capacity(), b.Free())
			require.Zero(t, b.Used())
			for _, s := range tc.excluded {
				require.True(t, b.IsUsed(addr(s)), "excluded stays used after Reset")
			}
		})
	}
}

func TestBlockAllocNextFit(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26}
	b := newBlockAlloc(t, p, "10.0.0.64/26")
	at := func(off int) netip.Addr {
		a, ok := allocator.AddrAt(b.Prefix(), off)
		require.True(t, ok)
		return a
	}

	for off := range 10 {
		a, ok := b.Next()
		require.True(t, ok)
		require.Equal(t, at(off), a)
		require.True(t, b.Mark(a))
	}
	require.True(t, b.Unmark(at(5)))
	require.False(t, b.Unmark(at(5)), "already free")
	require.False(t, b.IsUsed(at(5)))

	// The released address is passed over until the block has been walked.
	for off := 10; off < 64; off++ {
		a, ok := b.Next()
		require.True(t, ok)
		require.Equal(t, at(off), a, "offset 5 was released but must not come back yet")
		require.True(t, b.Mark(a))
	}
	a, ok := b.Next()
	require.True(t, ok)
	require.Equal(t, at(5), a, "after wrapping, the released address is the only free one")
	require.True(t, b.Mark(a))

	_, ok = b.Next()
	require.False(t, ok, "exhausted")
	require.Zero(t, b.Free())

	// Releases at both ends: the cursor is at 5, so 6.. comes before 0.
	require.True(t, b.Unmark(at(0)))
	require.True(t, b.Unmark(at(63)))
	a, _ = b.Next()
	require.Equal(t, at(63), a)
	a, _ = b.Next()
	require.Equal(t, at(0), a, "Next without Mark moves on")
	a, _ = b.Next()
	require.Equal(t, at(63), a)

	// Reset keeps the cursor, so recently handed out addresses stay last.
	b.Reset()
	a, _ = b.Next()
	require.Equal(t, at(0), a)
	a, _ = b.Next()
	require.Equal(t, at(1), a)
}

func TestBlockAllocMarkUnmark(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120}
	b := newBlockAlloc(t, p, "10.0.0.64/26")
	tests := []struct {
		name    string
		op      func(netip.Addr) bool
		addr    netip.Addr
		changed bool
		used    int
	}{
		{name: "mark", op: b.Mark, addr: addr("10.0.0.70"), changed: true, used: 1},
		{name: "mark again", op: b.Mark, addr: addr("10.0.0.70"), changed: false, used: 1},
		{name: "mark mapped", op: b.Mark, addr: addr("::ffff:10.0.0.71"), changed: true, used: 2},
		{name: "mark outside", op: b.Mark, addr: addr("10.0.0.128"), changed: false, used: 2},
		{name: "mark other family", op: b.Mark, addr: addr("fd00::70"), changed: false, used: 2},
		{name: "mark zero", op: b.Mark, addr: netip.Addr{}, changed: false, used: 2},
		{name: "unmark outside", op: b.Unmark, addr: addr("10.0.0.63"), changed: false, used: 2},
		{name: "unmark", op: b.Unmark, addr: addr("10.0.0.71"), changed: true, used: 1},
		{name: "unmark free", op: b.Unmark, addr: addr("10.0.0.71"), changed: false, used: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.changed, tc.op(tc.addr))
			require.Equal(t, tc.used, b.Used())
			require.Equal(t, 64-tc.used, b.Free())
		})
	}
	require.True(t, b.IsUsed(addr("10.0.0.70")))
	require.False(t, b.IsUsed(addr("10.0.0.71")))
	require.False(t, b.IsUsed(addr("10.0.0.128")), "outside the block")
}

func TestBlockAllocSmallBlocks(t *testing.T) {
	tests := []struct {
		name  string
		pool  allocator.Pool
		block string
		want  []string // in Next order, until exhausted
	}{
		{
			name:  "v4 /31 cidr, /31 block: both usable",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/31"), BlockSizeV4: 31},
			block: "10.0.0.0/31", want: []string{"10.0.0.0", "10.0.0.1"},
		},
		{
			name:  "v4 /31 cidr, /32 block",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/31"), BlockSizeV4: 32},
			block: "10.0.0.1/32", want: []string{"10.0.0.1"},
		},
		{
			name:  "v4 /32 cidr",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.9/32"), BlockSizeV4: 32},
			block: "10.0.0.9/32", want: []string{"10.0.0.9"},
		},
		{
			name:  "v4 /31 block at the start of a /24",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 31},
			block: "10.0.0.0/31", want: []string{"10.0.0.1"},
		},
		{
			name:  "v4 /31 block at the end of a /24",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 31},
			block: "10.0.0.254/31", want: []string{"10.0.0.254"},
		},
		{
			name:  "v4 /32 block on the network address has nothing",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/30"), BlockSizeV4: 32},
			block: "10.0.0.0/32",
		},
		{
			name:  "v4 /30 single block",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/30"), BlockSizeV4: 30},
			block: "10.0.0.0/30", want: []string{"10.0.0.1", "10.0.0.2"},
		},
		{
			name:  "v6 /127 cidr: both usable",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("fd00::/127"), BlockSizeV6: 127},
			block: "fd00::/127", want: []string{"fd00::", "fd00::1"},
		},
		{
			name:  "v6 /128 cidr",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("fd00::5/128"), BlockSizeV6: 128},
			block: "fd00::5/128", want: []string{"fd00::5"},
		},
		{
			name:  "v6 /127 block at the start of a /96",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("fd00:1::/96"), BlockSizeV6: 127},
			block: "fd00:1::/127", want: []string{"fd00:1::1"},
		},
		{
			name:  "v6 /126 single block",
			pool:  allocator.Pool{Name: "p", CIDRs: pfxs("fd00::/126"), BlockSizeV6: 126},
			block: "fd00::/126", want: []string{"fd00::1", "fd00::2", "fd00::3"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := newBlockAlloc(t, tc.pool, tc.block)
			require.Equal(t, len(tc.want), b.Capacity())
			var got []string
			for _, a := range drain(t, b) {
				got = append(got, a.String())
			}
			require.Equal(t, tc.want, got)
			require.Zero(t, b.Free())
		})
	}
}

func TestBlockAllocIPv6(t *testing.T) {
	p := allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/64"), BlockSizeV6: 120}
	last, err := allocator.BlockAt(p.CIDRs[0], 120, 1<<56-1)
	require.NoError(t, err)

	first := newBlockAlloc(t, p, "fd00::/120")
	require.Equal(t, 255, first.Capacity(), "subnet-router anycast fd00:: excluded")
	require.True(t, first.IsUsed(addr("fd00::")))
	a, ok := first.Next()
	require.True(t, ok)
	require.Equal(t, addr("fd00::1"), a)

	b := newBlockAlloc(t, p, last.String())
	require.Equal(t, 256, b.Capacity(), "no IPv6 broadcast")
	got := drain(t, b)
	require.Len(t, got, 256)
	require.Equal(t, addr("fd00::ffff:ffff:ffff:ff00"), got[0])
	require.Equal(t, addr("fd00::ffff:ffff:ffff:ffff"), got[255])
}

func TestBlockAllocLargest(t *testing.T) {
	p := allocator.Pool{Name: "big", CIDRs: pfxs("10.0.0.0/16", "fd00::/112"), BlockSizeV4: 16, BlockSizeV6: 112}
	v4 := newBlockAlloc(t, p, "10.0.0.0/16")
	require.Equal(t, 65534, v4.Capacity())
	require.Len(t, drain(t, v4), 65534)
	v6 := newBlockAlloc(t, p, "fd00::/112")
	require.Equal(t, 65535, v6.Capacity())
	require.Len(t, drain(t, v6), 65535)
}

// BenchmarkBlockAllocNext measures one allocate/release cycle in the largest
// block allowed (65536 addresses) when it is nearly full, the worst case for
// the free-bit scan.
func BenchmarkBlockAllocNext(b *testing.B) {
	p := allocator.Pool{Name: "bench", CIDRs: pfxs("10.0.0.0/16"), BlockSizeV4: 16}
	ba := newBlockAlloc(b, p, "10.0.0.0/16")
	drain(b, ba)
	// Leave 16 free addresses spread over the block.
	for i := range 16 {
		a, _ := allocator.AddrAt(ba.Prefix(), 1+i*4096)
		require.True(b, ba.Unmark(a))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		a, ok := ba.Next()
		if !ok || !ba.Mark(a) || !ba.Unmark(a) {
			b.Fatal("block unexpectedly full")
		}
	}
}

// ExampleBlockAlloc shows how an agent hands out addresses from a block it
// has claimed: Next proposes, Mark records once the allocation is stored.
func ExampleBlockAlloc() {
	pool := allocator.Pool{
		Name:        "default",
		CIDRs:       []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
		BlockSizeV4: 26,
	}
	if err := pool.Validate(); err != nil {
		panic(err)
	}
	block, _ := pool.BlockFor(netip.MustParseAddr("10.0.0.1"))
	b, err := allocator.NewBlockAlloc(pool, block)
	if err != nil {
		panic(err)
	}
	fmt.Println("block", allocator.BlockName(b.Prefix()), "excludes", pool.Excluded(block))
	for range 3 {
		a, _ := b.Next()
		// ... write the allocation to etcd, fenced on the claim, then:
		b.Mark(a)
		fmt.Println("allocated", a)
	}
	b.Unmark(netip.MustParseAddr("10.0.0.2"))
	a, _ := b.Next()
	fmt.Println("next after releasing 10.0.0.2:", a)
	fmt.Println("free", b.Free(), "of", b.Capacity())
	// Output:
	// block 10.0.0.0-26 excludes [10.0.0.0]
	// allocated 10.0.0.1
	// allocated 10.0.0.2
	// allocated 10.0.0.3
	// next after releasing 10.0.0.2: 10.0.0.4
	// free 61 of 63
}

func TestBlockAllocResumeAfter(t *testing.T) {
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 28}
	b, err := allocator.NewBlockAlloc(p, netip.MustParsePrefix("10.0.0.16/28"))
	require.NoError(t, err)
	b.ResumeAfter(netip.MustParseAddr("10.0.0.20"))
	a, ok := b.Next()
	require.True(t, ok)
	require.Equal(t, netip.MustParseAddr("10.0.0.21"), a)
}
