package allocator_test

import (
	"math"
	"math/big"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func TestBlockCount(t *testing.T) {
	tests := []struct {
		cidr string
		bits int
		want uint64
	}{
		{cidr: "10.0.0.0/24", bits: 26, want: 4},
		{cidr: "10.0.0.0/24", bits: 24, want: 1},
		{cidr: "10.0.0.0/24", bits: 32, want: 256},
		{cidr: "10.0.0.0/31", bits: 31, want: 1},
		{cidr: "10.0.0.0/31", bits: 32, want: 2},
		{cidr: "10.0.0.1/32", bits: 32, want: 1},
		{cidr: "10.0.0.0/8", bits: 16, want: 256},
		{cidr: "0.0.0.0/0", bits: 32, want: 1 << 32},
		{cidr: "10.0.0.7/24", bits: 26, want: 4}, // host bits ignored
		{cidr: "fd00::/64", bits: 120, want: 1 << 56},
		{cidr: "fd00::/126", bits: 127, want: 2},
		{cidr: "fd00::/127", bits: 128, want: 2},
		{cidr: "fd00::/64", bits: 127, want: 1 << 63},
		{cidr: "fd00::/64", bits: 128, want: math.MaxUint64}, // 2^64 saturates
		{cidr: "::/0", bits: 128, want: math.MaxUint64},
		{cidr: "10.0.0.0/24", bits: 23, want: 0},
		{cidr: "10.0.0.0/24", bits: 33, want: 0},
		{cidr: "fd00::/64", bits: -1, want: 0},
		{cidr: "fd00::/64", bits: 129, want: 0},
	}
	for _, tc := range tests {
		t.Run(tc.cidr+"/"+itoa(tc.bits), func(t *testing.T) {
			require.Equal(t, tc.want, allocator.BlockCount(pfx(tc.cidr), tc.bits))
		})
	}
	require.Zero(t, allocator.BlockCount(netip.Prefix{}, 24))
}

func itoa(i int) string { return big.NewInt(int64(i)).String() }

// bigBlockAt is an independent oracle for BlockAt, using math/big.
func bigBlockAt(cidr netip.Prefix, blockBits int, i uint64) netip.Prefix {
	a := cidr.Masked().Addr()
	n := new(big.Int).SetBytes(a.AsSlice())
	n.Add(n, new(big.Int).Lsh(new(big.Int).SetUint64(i), uint(a.BitLen()-blockBits)))
	buf := make([]byte, a.BitLen()/8)
	n.FillBytes(buf)
	got, _ := netip.AddrFromSlice(buf)
	return netip.PrefixFrom(got, blockBits)
}

func TestBlockAt(t *testing.T) {
	tests := []struct {
		cidr  string
		bits  int
		i     uint64
		block string
	}{
		{cidr: "10.0.0.0/24", bits: 26, i: 0, block: "10.0.0.0/26"},
		{cidr: "10.0.0.0/24", bits: 26, i: 3, block: "10.0.0.192/26"},
		{cidr: "10.0.0.0/8", bits: 26, i: 1<<18 - 1, block: "10.255.255.192/26"},
		{cidr: "10.0.0.0/31", bits: 32, i: 1, block: "10.0.0.1/32"},
		{cidr: "10.0.0.5/32", bits: 32, i: 0, block: "10.0.0.5/32"},
		{cidr: "0.0.0.0/0", bits: 32, i: 1<<32 - 1, block: "255.255.255.255/32"},
		{cidr: "10.0.0.9/24", bits: 26, i: 1, block: "10.0.0.64/26"}, // host bits ignored
		{cidr: "fd00::/64", bits: 120, i: 0, block: "fd00::/120"},
		{cidr: "fd00::/64", bits: 120, i: 1<<56 - 1, block: "fd00::ffff:ffff:ffff:ff00/120"},
		{cidr: "fd00::/64", bits: 120, i: 1<<56 - 0x10001, block: "fd00::ffff:ffff:feff:ff00/120"},
		{cidr: "fd00::/127", bits: 128, i: 1, block: "fd00::1/128"},
		// Index bits straddle the two 64-bit halves of the address.
		{cidr: "fd00::/56", bits: 112, i: 1<<56 - 1, block: "fd00:0:0:ff:ffff:ffff:ffff:0/112"},
		{cidr: "fd00::/60", bits: 120, i: 1<<60 - 1, block: "fd00:0:0:f:ffff:ffff:ffff:ff00/120"},
		{cidr: "::/0", bits: 128, i: math.MaxUint64, block: "::ffff:ffff:ffff:ffff/128"},
		{cidr: "::/0", bits: 64, i: math.MaxUint64, block: "ffff:ffff:ffff:ffff::/64"},
	}
	for _, tc := range tests {
		t.Run(tc.cidr+"/"+itoa(tc.bits)+"/"+new(big.Int).SetUint64(tc.i).String(), func(t *testing.T) {
			b, err := allocator.BlockAt(pfx(tc.cidr), tc.bits, tc.i)
			require.NoError(t, err)
			require.Equal(t, pfx(tc.block), b)
			require.Equal(t, bigBlockAt(pfx(tc.cidr), tc.bits, tc.i), b)
			i, ok := allocator.BlockIndex(pfx(tc.cidr).Masked(), tc.bits, b)
			require.True(t, ok)
			require.Equal(t, tc.i, i)
		})
	}

	errs := []struct {
		name string
		cidr netip.Prefix
		bits int
		i    uint64
		err  error
	}{
		{name: "past the end", cidr: pfx("10.0.0.0/24"), bits: 26, i: 4, err: allocator.ErrBlockIndexOutOfRange},
		{name: "past the end v6", cidr: pfx("fd00::/64"), bits: 120, i: 1 << 56, err: allocator.ErrBlockIndexOutOfRange},
		{name: "huge index", cidr: pfx("10.0.0.0/8"), bits: 32, i: math.MaxUint64, err: allocator.ErrBlockIndexOutOfRange},
		{name: "block larger than cidr", cidr: pfx("10.0.0.0/24"), bits: 16, err: allocator.ErrInvalidBlock},
		{name: "block size past 32", cidr: pfx("10.0.0.0/24"), bits: 33, err: allocator.ErrInvalidBlock},
		{name: "negative block size", cidr: pfx("fd00::/64"), bits: -3, err: allocator.ErrInvalidBlock},
		{name: "zero prefix", cidr: netip.Prefix{}, bits: 26, err: allocator.ErrInvalidBlock},
	}
	for _, tc := range errs {
		t.Run(tc.name, func(t *testing.T) {
			_, err := allocator.BlockAt(tc.cidr, tc.bits, tc.i)
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, "block at")
		})
	}
}

func TestBlockAtMatchesBig(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	cases := []struct {
		cidr string
		bits int
	}{
		{cidr: "10.0.0.0/8", bits: 26},
		{cidr: "172.16.0.0/12", bits: 32},
		{cidr: "fd00:1:2:3::/64", bits: 120},
		{cidr: "fd00:1:2::/50", bits: 112},
		{cidr: "2001:db8::/66", bits: 128},
	}
	for _, tc := range cases {
		t.Run(tc.cidr, func(t *testing.T) {
			cidr := pfx(tc.cidr)
			n := allocator.BlockCount(cidr, tc.bits)
			for range 1000 {
				i := r.Uint64N(n)
				b, err := allocator.BlockAt(cidr, tc.bits, i)
				require.NoError(t, err)
				require.Equal(t, bigBlockAt(cidr, tc.bits, i), b)
				got, ok := allocator.BlockIndex(cidr, tc.bits, b)
				require.True(t, ok)
				require.Equal(t, i, got)
			}
		})
	}
}

func TestBlockIndexRejects(t *testing.T) {
	cidr := pfx("10.0.0.0/24")
	tests := []struct {
		name  string
		cidr  netip.Prefix
		bits  int
		block netip.Prefix
	}{
		{name: "wrong size", cidr: cidr, bits: 26, block: pfx("10.0.0.0/27")},
		{name: "host bits", cidr: cidr, bits: 26, block: pfx("10.0.0.1/26")},
		{name: "outside", cidr: cidr, bits: 26, block: pfx("10.0.1.0/26")},
		{name: "other family", cidr: cidr, bits: 26, block: pfx("fd00::/26")},
		{name: "mapped", cidr: cidr, bits: 26, block: pfx("::ffff:10.0.0.0/26")},
		{name: "zero block", cidr: cidr, bits: 26, block: netip.Prefix{}},
		{name: "zero cidr", cidr: netip.Prefix{}, bits: 26, block: pfx("10.0.0.0/26")},
		{name: "block bits shorter than cidr", cidr: cidr, bits: 16, block: pfx("10.0.0.0/16")},
		{name: "index does not fit uint64", cidr: pfx("::/0"), bits: 128, block: pfx("1::/128")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, ok := allocator.BlockIndex(tc.cidr, tc.bits, tc.block)
			require.False(t, ok)
		})
	}
}

func TestBlockSize(t *testing.T) {
	tests := []struct {
		block netip.Prefix
		want  int
	}{
		{block: pfx("10.0.0.0/26"), want: 64},
		{block: pfx("10.0.0.0/16"), want: 65536},
		{block: pfx("10.0.0.0/31"), want: 2},
		{block: pfx("10.0.0.0/32"), want: 1},
		{block: pfx("0.0.0.0/0"), want: 1 << 32},
		{block: pfx("fd00::/120"), want: 256},
		{block: pfx("fd00::/112"), want: 65536},
		{block: pfx("fd00::/127"), want: 2},
		{block: pfx("fd00::/128"), want: 1},
		{block: pfx("fd00::/66"), want: 1 << 62},
		{block: pfx("fd00::/64"), want: math.MaxInt},
		{block: pfx("::/0"), want: math.MaxInt},
		{block: netip.Prefix{}, want: 0},
	}
	for _, tc := range tests {
		t.Run(tc.block.String(), func(t *testing.T) {
			require.Equal(t, tc.want, allocator.BlockSize(tc.block))
		})
	}
}

func TestAddrAtOffset(t *testing.T) {
	tests := []struct {
		block string
		off   int
		addr  string // "" when off is outside the block
	}{
		{block: "10.0.0.64/26", off: 0, addr: "10.0.0.64"},
		{block: "10.0.0.64/26", off: 63, addr: "10.0.0.127"},
		{block: "10.0.0.64/26", off: 64},
		{block: "10.0.0.64/26", off: -1},
		{block: "10.0.0.0/16", off: 65535, addr: "10.0.255.255"},
		{block: "255.255.255.254/31", off: 1, addr: "255.255.255.255"},
		{block: "10.0.0.7/32", off: 0, addr: "10.0.0.7"},
		{block: "10.0.0.7/32", off: 1},
		{block: "fd00::100/120", off: 0, addr: "fd00::100"},
		{block: "fd00::100/120", off: 255, addr: "fd00::1ff"},
		{block: "fd00::ffff:ffff:ffff:ff00/120", off: 255, addr: "fd00::ffff:ffff:ffff:ffff"},
		{block: "fd00:0:0:1::/112", off: 0xabcd, addr: "fd00:0:0:1::abcd"},
		{block: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ff00/120", off: 255, addr: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"},
		{block: "fd00::/127", off: 1, addr: "fd00::1"},
		{block: "fd00::/128", off: 0, addr: "fd00::"},
		{block: "fd00::/128", off: 1},
		{block: "fd00::/64", off: math.MaxInt - 1, addr: "fd00::7fff:ffff:ffff:fffe"},
	}
	for _, tc := range tests {
		t.Run(tc.block+"+"+itoa(tc.off), func(t *testing.T) {
			a, ok := allocator.AddrAt(pfx(tc.block), tc.off)
			if tc.addr == "" {
				require.False(t, ok)
				return
			}
			require.True(t, ok)
			require.Equal(t, addr(tc.addr), a)
			off, ok := allocator.Offset(pfx(tc.block), a)
			require.True(t, ok)
			require.Equal(t, tc.off, off)
		})
	}

	offsets := []struct {
		name  string
		block netip.Prefix
		addr  netip.Addr
		off   int
		ok    bool
	}{
		{name: "mapped counts as ipv4", block: pfx("10.0.0.0/24"), addr: addr("::ffff:10.0.0.9"), off: 9, ok: true},
		{name: "outside", block: pfx("10.0.0.0/24"), addr: addr("10.0.1.0")},
		{name: "other family", block: pfx("10.0.0.0/24"), addr: addr("fd00::1")},
		{name: "zone", block: pfx("fe80::/120"), addr: addr("fe80::1%eth0")},
		{name: "zero addr", block: pfx("10.0.0.0/24"), addr: netip.Addr{}},
		{name: "zero block", block: netip.Prefix{}, addr: addr("10.0.0.1")},
		{name: "offset does not fit int", block: pfx("::/0"), addr: addr("8000::")},
		{name: "unmasked block", block: pfx("10.0.0.7/24"), addr: addr("10.0.0.9"), off: 9, ok: true},
	}
	for _, tc := range offsets {
		t.Run(tc.name, func(t *testing.T) {
			off, ok := allocator.Offset(tc.block, tc.addr)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.off, off)
		})
	}
	_, ok := allocator.AddrAt(netip.Prefix{}, 0)
	require.False(t, ok)
}

func TestBlockName(t *testing.T) {
	tests := []struct {
		block string
		name  string
	}{
		{block: "10.0.1.0/26", name: "10.0.1.0-26"},
		{block: "0.0.0.0/0", name: "0.0.0.0-0"},
		{block: "255.255.255.255/32", name: "255.255.255.255-32"},
		{block: "192.168.0.0/31", name: "192.168.0.0-31"},
		{block: "fd00::100/120", name: "fd00--100-120"},
		{block: "fd00::1:0/120", name: "fd00--1-0-120"},
		{block: "fd00::/120", name: "fd00---120"},
		{block: "::/120", name: "---120"},
		{block: "::/0", name: "---0"},
		{block: "::1/128", name: "--1-128"},
		{block: "2001:db8:1:2:3:4:5:600/120", name: "2001-db8-1-2-3-4-5-600-120"},
		{block: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128", name: "ffff-ffff-ffff-ffff-ffff-ffff-ffff-ffff-128"},
		{block: "fd00:0:0:1::/64", name: "fd00-0-0-1---64"},
		{block: "::ffff:10.0.0.0/120", name: "--ffff-10.0.0.0-120"},
	}
	for _, tc := range tests {
		t.Run(tc.block, func(t *testing.T) {
			require.Equal(t, tc.name, allocator.BlockName(pfx(tc.block)))
			got, err := allocator.ParseBlockName(tc.name)
			require.NoError(t, err)
			require.Equal(t, pfx(tc.block), got)
		})
	}
	require.Equal(t, "10.0.1.0-26", allocator.BlockName(pfx("10.0.1.9/26")), "written masked")
	require.Equal(t, "", allocator.BlockName(netip.Prefix{}))
}

func TestBlockNameRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	check := func(t *testing.T, b netip.Prefix) {
		t.Helper()
		name := allocator.BlockName(b)
		require.NotContains(t, name, ":")
		require.NotContains(t, name, "/")
		got, err := allocator.ParseBlockName(name)
		require.NoError(t, err, name)
		require.Equal(t, b, got, name)
	}
	// Every block of some small CIDRs, then random blocks everywhere.
	for _, c := range []struct {
		cidr string
		bits int
	}{
		{cidr: "10.0.0.0/24", bits: 30},
		{cidr: "0.0.0.0/0", bits: 8},
		{cidr: "::/120", bits: 128},
		{cidr: "fd00::/112", bits: 120},
		{cidr: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:0/112", bits: 124},
	} {
		for i := range allocator.BlockCount(pfx(c.cidr), c.bits) {
			b, err := allocator.BlockAt(pfx(c.cidr), c.bits, i)
			require.NoError(t, err)
			check(t, b)
		}
	}
	for range 5000 {
		var a [16]byte
		for i := range a {
			// Runs of zero bytes exercise "::" compression.
			if r.IntN(3) > 0 {
				a[i] = byte(r.UintN(256))
			}
		}
		v6, _ := netip.AddrFrom16(a).Prefix(r.IntN(129))
		check(t, v6)
		v4, _ := netip.AddrFrom4([4]byte(a[:4])).Prefix(r.IntN(33))
		check(t, v4)
	}
}

func TestParseBlockNameRejects(t *testing.T) {
	tests := []string{
		"",
		"-",
		"10.0.1.0",
		"10.0.1.0/26",
		"10.0.1.0-",
		"10.0.1.0-x",
		"10.0.1.0-33",
		"10.0.1.0--1",
		"10.0.1.0-+26",
		"10.0.1.0-026",
		"10.0.1.1-26",
		"010.0.1.0-26",
		"10.0.1-26",
		"fd00::100/120",
		"fd00::100-120",
		"FD00--100-120",
		"fd00-0-0-0-0-0-0-100-120",
		"fd00--0100-120",
		"fd00--100-129",
		"fd00--101-120",
		"fe80--1%eth0-128",
		"fd00--100-120-",
		"fd00-----120",
		"--ffff-10.0.0.0",
		"10.0.0.0-26 ",
		" 10.0.0.0-26",
		"10.0.0.0-99999999999999999999999",
		strings.Repeat("-", 50),
	}
	for _, s := range tests {
		t.Run(s, func(t *testing.T) {
			_, err := allocator.ParseBlockName(s)
			require.ErrorIs(t, err, allocator.ErrInvalidBlockName)
			require.ErrorContains(t, err, "parse block name")
		})
	}
}

func FuzzParseBlockName(f *testing.F) {
	for _, s := range []string{
		"10.0.1.0-26", "fd00--100-120", "---120", "fd00---120", "--1-128",
		"ffff-ffff-ffff-ffff-ffff-ffff-ffff-ffff-128", "--ffff-10.0.0.0-120",
		"10.0.1.1-26", "FD00--100-120", "fe80--1%eth0-128", "", "-", "1-2-3",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := allocator.ParseBlockName(s)
		if err != nil {
			require.ErrorIs(t, err, allocator.ErrInvalidBlockName)
			return
		}
		require.True(t, p.IsValid())
		require.Equal(t, p.Masked(), p)
		require.Equal(t, s, allocator.BlockName(p))
		again, err := allocator.ParseBlockName(allocator.BlockName(p))
		require.NoError(t, err)
		require.Equal(t, p, again)
	})
}
