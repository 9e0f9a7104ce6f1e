package allocator_test

import (
	"encoding/json"
	"errors"
	"math"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func pfxs(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = pfx(s)
	}
	return out
}

func TestFamily(t *testing.T) {
	require.Equal(t, "ipv4", allocator.IPv4.String())
	require.Equal(t, "ipv6", allocator.IPv6.String())
	require.Equal(t, "Family(5)", allocator.Family(5).String())

	parse := []struct {
		in   string
		want allocator.Family
		err  bool
	}{
		{in: "4", want: allocator.IPv4},
		{in: "ipv4", want: allocator.IPv4},
		{in: "v4", want: allocator.IPv4},
		{in: "IPv4", want: allocator.IPv4},
		{in: "6", want: allocator.IPv6},
		{in: "ipv6", want: allocator.IPv6},
		{in: "v6", want: allocator.IPv6},
		{in: "V6", want: allocator.IPv6},
		{in: "", err: true},
		{in: "ip4", err: true},
		{in: "46", err: true},
		{in: " ipv4", err: true},
	}
	for _, tc := range parse {
		t.Run("parse/"+tc.in, func(t *testing.T) {
			f, err := allocator.ParseFamily(tc.in)
			if tc.err {
				require.ErrorIs(t, err, allocator.ErrInvalidFamily)
				require.ErrorContains(t, err, "parse family")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, f)
		})
	}

	of := []struct {
		in   netip.Addr
		want allocator.Family
	}{
		{in: addr("10.0.0.1"), want: allocator.IPv4},
		{in: addr("::ffff:10.0.0.1"), want: allocator.IPv4},
		{in: addr("fd00::1"), want: allocator.IPv6},
		{in: addr("fe80::1%eth0"), want: allocator.IPv6},
		{in: netip.Addr{}, want: 0},
	}
	for _, tc := range of {
		t.Run("of/"+tc.in.String(), func(t *testing.T) {
			require.Equal(t, tc.want, allocator.FamilyOf(tc.in))
		})
	}
}

func TestPoolValidate(t *testing.T) {
	tests := []struct {
		name string
		pool allocator.Pool
		err  string // substring of the error; "" means valid
	}{
		{
			name: "ipv4",
			pool: allocator.Pool{Name: "default", CIDRs: pfxs("10.0.0.0/16"), BlockSizeV4: 26},
		},
		{
			name: "dual stack, several cidrs",
			pool: allocator.Pool{Name: "blue-1", CIDRs: pfxs("10.0.0.0/16", "fd00::/64", "10.1.0.0/24", "fd01::/112"),
				BlockSizeV4: 26, BlockSizeV6: 120},
		},
		{
			name: "ipv6 /64 with /120 blocks",
			pool: allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/64"), BlockSizeV6: 120},
		},
		{
			name: "ipv6 /50 with /112 blocks is at the block count limit",
			pool: allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/50"), BlockSizeV6: 112},
		},
		{
			name: "ipv4 /16 block is the largest",
			pool: allocator.Pool{Name: "big", CIDRs: pfxs("10.0.0.0/8"), BlockSizeV4: 16},
		},
		{
			name: "ipv4 /31 and /32 cidrs",
			pool: allocator.Pool{Name: "p2p", CIDRs: pfxs("192.168.0.0/31", "192.168.0.2/32"), BlockSizeV4: 32},
		},
		{
			name: "ipv4 /31 blocks",
			pool: allocator.Pool{Name: "p2p", CIDRs: pfxs("192.168.0.0/24"), BlockSizeV4: 31},
		},
		{
			name: "ipv6 /127 and /128 cidrs",
			pool: allocator.Pool{Name: "p2p6", CIDRs: pfxs("fd00::/127", "fd00::2/128"), BlockSizeV6: 128},
		},
		{
			name: "digit first, 63 characters",
			pool: allocator.Pool{Name: "0" + strings.Repeat("a", 62), CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
		},
		{
			name: "empty name",
			pool: allocator.Pool{CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "name is empty",
		},
		{
			name: "64 characters",
			pool: allocator.Pool{Name: strings.Repeat("a", 64), CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "name is 64 characters long, at most 63 allowed",
		},
		{
			name: "upper case",
			pool: allocator.Pool{Name: "Blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "name has character 'B'",
		},
		{
			name: "slash in name",
			pool: allocator.Pool{Name: "a/b", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "name has character '/'",
		},
		{
			name: "non-ascii name",
			pool: allocator.Pool{Name: "bl\u00fce", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "name has character 'ü'",
		},
		{
			name: "leading dash",
			pool: allocator.Pool{Name: "-blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26},
			err:  "must start with a letter or digit",
		},
		{
			name: "no cidrs",
			pool: allocator.Pool{Name: "blue", BlockSizeV4: 26},
			err:  "no cidrs",
		},
		{
			name: "zero prefix",
			pool: allocator.Pool{Name: "blue", CIDRs: []netip.Prefix{pfx("10.0.0.0/24"), {}}, BlockSizeV4: 26},
			err:  "cidrs[1] is not a valid prefix",
		},
		{
			name: "host bits",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.1/24"), BlockSizeV4: 26},
			err:  "cidr 10.0.0.1/24 has host bits set, did you mean 10.0.0.0/24",
		},
		{
			name: "ipv6 host bits",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::1/64"), BlockSizeV6: 120},
			err:  "cidr fd00::1/64 has host bits set, did you mean fd00::/64",
		},
		{
			name: "ipv4-mapped",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("::ffff:10.0.0.0/120"), BlockSizeV6: 120},
			err:  "cidr ::ffff:10.0.0.0/120 overlaps the IPv4-mapped IPv6 range",
		},
		{
			name: "ipv6 cidr covering the mapped range",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("::/64"), BlockSizeV6: 120},
			err:  "cidr ::/64 overlaps the IPv4-mapped IPv6 range",
		},
		{
			name: "ipv4 overlap",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/16", "192.168.0.0/24", "10.0.1.0/24"), BlockSizeV4: 26},
			err:  "cidrs 10.0.0.0/16 and 10.0.1.0/24 overlap",
		},
		{
			name: "ipv4 duplicate",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "10.0.0.0/24"), BlockSizeV4: 26},
			err:  "cidrs 10.0.0.0/24 and 10.0.0.0/24 overlap",
		},
		{
			name: "ipv6 overlap",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/112", "10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120},
			err:  "cidrs fd00::/112 and fd00::/64 overlap",
		},
		{
			name: "ipv4 block size missing",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/64", "10.0.0.0/24"), BlockSizeV6: 120},
			err:  "blockSizeV4 is not set but the pool has ipv4 cidr 10.0.0.0/24",
		},
		{
			name: "ipv6 block size without ipv6 cidr",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26, BlockSizeV6: 120},
			err:  "blockSizeV6 is 120 but the pool has no ipv6 cidr",
		},
		{
			name: "block larger than cidr",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.1.0.0/16", "10.0.0.0/26"), BlockSizeV4: 24},
			err:  "block /24 is larger than cidr 10.0.0.0/26",
		},
		{
			name: "ipv4 block size past 32",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 33},
			err:  "blockSizeV4 33 is out of range, want 16 to 32",
		},
		{
			name: "negative block size",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: -1},
			err:  "blockSizeV4 -1 is out of range",
		},
		{
			name: "ipv6 block size past 128",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/64"), BlockSizeV6: 129},
			err:  "blockSizeV6 129 is out of range, want 112 to 128",
		},
		{
			name: "ipv4 block too many addresses",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/8"), BlockSizeV4: 15},
			err:  "block /15 holds 2^17 addresses, at most 2^16 allowed (use /16 or longer)",
		},
		{
			name: "ipv6 block too many addresses",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/64"), BlockSizeV6: 64},
			err:  "block /64 holds 2^64 addresses",
		},
		{
			name: "ipv6 /48 has too many /120 blocks",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/48"), BlockSizeV6: 120},
			err:  "cidr fd00::/48 has 2^72 blocks of /120, at most 2^62 allowed (split it into cidrs of /58 or longer)",
		},
		{
			name: "ipv6 /49 has too many /112 blocks",
			pool: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/49"), BlockSizeV6: 112},
			err:  "2^63 blocks",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.pool.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, allocator.ErrInvalidPool)
			require.ErrorContains(t, err, tc.err)
			require.ErrorContains(t, err, `validate pool "`+tc.pool.Name+`"`)
		})
	}
}

func TestCheckPoolUpdate(t *testing.T) {
	prev := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120}
	v4only := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 26}

	tests := []struct {
		name       string
		prev, next allocator.Pool
		err        error
		msg        string
	}{
		{name: "unchanged", prev: prev, next: prev},
		{
			name: "cidr added",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.1.0/24", "fd00::/64", "10.0.0.0/24"), BlockSizeV4: 26, BlockSizeV6: 120},
		},
		{
			name: "family added with its block size",
			prev: v4only,
			next: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120},
		},
		{
			name: "next invalid",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "10.0.0.0/25"), BlockSizeV4: 26, BlockSizeV6: 120},
			err:  allocator.ErrInvalidPool,
			msg:  "overlap",
		},
		{
			name: "renamed",
			prev: prev,
			next: allocator.Pool{Name: "green", CIDRs: prev.CIDRs, BlockSizeV4: 26, BlockSizeV6: 120},
			err:  allocator.ErrPoolRenamed,
			msg:  `new name "green"`,
		},
		{
			name: "ipv4 block size changed",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: prev.CIDRs, BlockSizeV4: 27, BlockSizeV6: 120},
			err:  allocator.ErrBlockSizeImmutable,
			msg:  "ipv4 block size /26 changed to /27",
		},
		{
			name: "ipv6 block size changed",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: prev.CIDRs, BlockSizeV4: 26, BlockSizeV6: 112},
			err:  allocator.ErrBlockSizeImmutable,
			msg:  "ipv6 block size /120 changed to /112",
		},
		{
			name: "family removed",
			prev: prev,
			next: v4only,
			err:  allocator.ErrBlockSizeImmutable,
			msg:  "ipv6 block size /120 changed to /0",
		},
		{
			name: "cidr removed",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/64", "10.0.1.0/24"), BlockSizeV4: 26, BlockSizeV6: 120},
			err:  allocator.ErrCIDRRemoved,
			msg:  "cidr 10.0.0.0/24 is missing",
		},
		{
			name: "cidr grown counts as removed",
			prev: prev,
			next: allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/23", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120},
			err:  allocator.ErrCIDRRemoved,
			msg:  "cidr 10.0.0.0/24 is missing",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := allocator.CheckPoolUpdate(tc.prev, tc.next)
			if tc.err == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, tc.msg)
			require.ErrorContains(t, err, "check pool update")
			for _, other := range []error{allocator.ErrInvalidPool, allocator.ErrPoolRenamed, allocator.ErrBlockSizeImmutable, allocator.ErrCIDRRemoved} {
				if other != tc.err {
					require.False(t, errors.Is(err, other), "also matches %v", other)
				}
			}
		})
	}
}

func TestPoolAccessors(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("fd00::/64", "10.0.0.0/24", "10.1.0.0/16"), BlockSizeV4: 26, BlockSizeV6: 120}
	require.NoError(t, p.Validate())

	require.Equal(t, []allocator.Family{allocator.IPv4, allocator.IPv6}, p.Families())
	require.Equal(t, pfxs("10.0.0.0/24", "10.1.0.0/16"), p.CIDRsOf(allocator.IPv4))
	require.Equal(t, pfxs("fd00::/64"), p.CIDRsOf(allocator.IPv6))
	require.Empty(t, p.CIDRsOf(allocator.Family(0)))
	require.Equal(t, 26, p.BlockSize(allocator.IPv4))
	require.Equal(t, 120, p.BlockSize(allocator.IPv6))
	require.Equal(t, 0, p.BlockSize(allocator.Family(5)))
	require.Equal(t, uint64(4+1024), p.BlockCount(allocator.IPv4))
	require.Equal(t, uint64(1)<<56, p.BlockCount(allocator.IPv6))

	v6only := allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120}
	require.Equal(t, []allocator.Family{allocator.IPv6}, v6only.Families())
	require.Equal(t, 0, v6only.BlockSize(allocator.IPv4), "no ipv4 cidr, so no ipv4 block size")
	require.Equal(t, uint64(0), v6only.BlockCount(allocator.IPv4))
	require.Empty(t, allocator.Pool{}.Families())

	lookups := []struct {
		addr  netip.Addr
		block string // "" when not in the pool
		cidr  string
	}{
		{addr: addr("10.0.0.0"), block: "10.0.0.0/26", cidr: "10.0.0.0/24"},
		{addr: addr("10.0.0.77"), block: "10.0.0.64/26", cidr: "10.0.0.0/24"},
		{addr: addr("10.0.0.255"), block: "10.0.0.192/26", cidr: "10.0.0.0/24"},
		{addr: addr("::ffff:10.0.0.77"), block: "10.0.0.64/26", cidr: "10.0.0.0/24"},
		{addr: addr("10.1.200.3"), block: "10.1.200.0/26", cidr: "10.1.0.0/16"},
		{addr: addr("fd00::1234"), block: "fd00::1200/120", cidr: "fd00::/64"},
		{addr: addr("fd00::ffff:ffff:ffff:ffff"), block: "fd00::ffff:ffff:ffff:ff00/120", cidr: "fd00::/64"},
		{addr: addr("10.0.1.0")},
		{addr: addr("fd00:0:0:1::")},
		{addr: addr("fd00::1%eth0")},
		{addr: netip.Addr{}},
	}
	for _, tc := range lookups {
		t.Run("lookup/"+tc.addr.String(), func(t *testing.T) {
			require.Equal(t, tc.block != "", p.Contains(tc.addr))
			b, ok := p.BlockFor(tc.addr)
			if tc.block == "" {
				require.False(t, ok)
				return
			}
			require.True(t, ok)
			require.Equal(t, pfx(tc.block), b)
			c, ok := p.CIDRFor(b)
			require.True(t, ok)
			require.Equal(t, pfx(tc.cidr), c)
		})
	}

	notBlocks := []netip.Prefix{
		{},
		pfx("10.0.0.0/25"),         // wrong size
		pfx("10.0.0.1/26"),         // host bits
		pfx("10.0.1.0/26"),         // outside the pool
		pfx("fd00::/112"),          // wrong size
		pfx("fd00:1::/120"),        // outside the pool
		pfx("::ffff:10.0.0.0/120"), // mapped, IPv6 by prefix
	}
	for _, b := range notBlocks {
		t.Run("cidr for/"+b.String(), func(t *testing.T) {
			_, ok := p.CIDRFor(b)
			require.False(t, ok)
			require.Nil(t, p.Excluded(b))
		})
	}
}

func TestPoolIPv6Slash64(t *testing.T) {
	p := allocator.Pool{Name: "v6", CIDRs: pfxs("fd00:1:2:3::/64"), BlockSizeV6: 120}
	require.NoError(t, p.Validate())
	require.Equal(t, uint64(1)<<56, p.BlockCount(allocator.IPv6))
	require.Equal(t, uint64(1)<<56, allocator.BlockCount(p.CIDRs[0], 120))

	tests := []struct {
		name  string
		i     uint64
		block string
	}{
		{name: "first", i: 0, block: "fd00:1:2:3::/120"},
		{name: "second", i: 1, block: "fd00:1:2:3::100/120"},
		{name: "middle", i: 1 << 55, block: "fd00:1:2:3:8000::/120"},
		{name: "middle plus", i: 1<<55 + 0x123456, block: "fd00:1:2:3:8000::1234:5600/120"},
		{name: "last but one", i: 1<<56 - 2, block: "fd00:1:2:3:ffff:ffff:ffff:fe00/120"},
		{name: "last", i: 1<<56 - 1, block: "fd00:1:2:3:ffff:ffff:ffff:ff00/120"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := allocator.BlockAt(p.CIDRs[0], 120, tc.i)
			require.NoError(t, err)
			require.Equal(t, pfx(tc.block), b)
			i, ok := allocator.BlockIndex(p.CIDRs[0], 120, b)
			require.True(t, ok)
			require.Equal(t, tc.i, i)

			last, ok := allocator.AddrAt(b, 255)
			require.True(t, ok)
			got, ok := p.BlockFor(last)
			require.True(t, ok)
			require.Equal(t, b, got)
			c, ok := p.CIDRFor(b)
			require.True(t, ok)
			require.Equal(t, p.CIDRs[0], c)
		})
	}

	_, err := allocator.BlockAt(p.CIDRs[0], 120, 1<<56)
	require.ErrorIs(t, err, allocator.ErrBlockIndexOutOfRange)
}

func TestPoolExcluded(t *testing.T) {
	v4 := allocator.Pool{Name: "v4", CIDRs: pfxs("10.0.0.0/24", "10.0.1.0/26"), BlockSizeV4: 26}
	v4small := allocator.Pool{Name: "v4", CIDRs: pfxs("10.0.0.0/24", "10.0.1.0/31", "10.0.1.2/32", "10.0.1.4/30"), BlockSizeV4: 32}
	v4p2p := allocator.Pool{Name: "v4", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 31}
	v6 := allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/64", "fd01::/120"), BlockSizeV6: 120}
	v6small := allocator.Pool{Name: "v6", CIDRs: pfxs("fd00::/112", "fd01::/127", "fd01::2/128", "fd01::4/126"), BlockSizeV6: 128}

	tests := []struct {
		name  string
		pool  allocator.Pool
		block string
		want  []string
	}{
		{name: "v4 first block of /24", pool: v4, block: "10.0.0.0/26", want: []string{"10.0.0.0"}},
		{name: "v4 middle block of /24", pool: v4, block: "10.0.0.64/26"},
		{name: "v4 middle block of /24 (2)", pool: v4, block: "10.0.0.128/26"},
		{name: "v4 last block of /24", pool: v4, block: "10.0.0.192/26", want: []string{"10.0.0.255"}},
		{name: "v4 /31 cidr", pool: v4small, block: "10.0.1.1/32"},
		{name: "v4 /32 cidr", pool: v4small, block: "10.0.1.2/32"},
		{name: "v4 /30 cidr network", pool: v4small, block: "10.0.1.4/32", want: []string{"10.0.1.4"}},
		{name: "v4 /30 cidr middle", pool: v4small, block: "10.0.1.5/32"},
		{name: "v4 /30 cidr broadcast", pool: v4small, block: "10.0.1.7/32", want: []string{"10.0.1.7"}},
		{name: "v4 /31 block first", pool: v4p2p, block: "10.0.0.0/31", want: []string{"10.0.0.0"}},
		{name: "v4 /31 block last", pool: v4p2p, block: "10.0.0.254/31", want: []string{"10.0.0.255"}},
		{name: "v6 first block of /64", pool: v6, block: "fd00::/120", want: []string{"fd00::"}},
		{name: "v6 last block of /64", pool: v6, block: "fd00::ffff:ffff:ffff:ff00/120"},
		{name: "v6 block is whole /120 cidr", pool: v6, block: "fd01::/120", want: []string{"fd01::"}},
		{name: "v4 block is whole /26 cidr", pool: v4, block: "10.0.1.0/26", want: []string{"10.0.1.0", "10.0.1.63"}},
		{name: "v4 /32 block at start of /24", pool: v4small, block: "10.0.0.0/32", want: []string{"10.0.0.0"}},
		{name: "v4 /32 block inside /24", pool: v4small, block: "10.0.0.1/32"},
		{name: "v6 /128 block at start of /112", pool: v6small, block: "fd00::/128", want: []string{"fd00::"}},
		{name: "v6 /128 block at end of /112", pool: v6small, block: "fd00::ffff/128"},
		{name: "v6 /127 cidr", pool: v6small, block: "fd01::/128"},
		{name: "v6 /128 cidr", pool: v6small, block: "fd01::2/128"},
		{name: "v6 /126 cidr first", pool: v6small, block: "fd01::4/128", want: []string{"fd01::4"}},
		{name: "v6 /126 cidr last", pool: v6small, block: "fd01::7/128"},
		{name: "not a block", pool: v4, block: "10.0.0.0/25"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, tc.pool.Validate())
			var want []netip.Addr
			for _, s := range tc.want {
				want = append(want, addr(s))
			}
			require.Equal(t, want, tc.pool.Excluded(pfx(tc.block)))
		})
	}

	// Two /31 CIDRs differ from one /30: both get all addresses.
	t.Run("v4 /30 split into two /31", func(t *testing.T) {
		p := allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/31", "10.0.0.2/31"), BlockSizeV4: 31}
		require.NoError(t, p.Validate())
		require.Nil(t, p.Excluded(pfx("10.0.0.0/31")))
		require.Nil(t, p.Excluded(pfx("10.0.0.2/31")))
	})

	t.Run("single block covers the whole /24", func(t *testing.T) {
		p := allocator.Pool{Name: "p", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 24}
		require.NoError(t, p.Validate())
		require.Equal(t, []netip.Addr{addr("10.0.0.0"), addr("10.0.0.255")}, p.Excluded(pfx("10.0.0.0/24")))
	})
}

func TestPoolJSON(t *testing.T) {
	p := allocator.Pool{Name: "blue", CIDRs: pfxs("10.0.0.0/24", "fd00::/64"), BlockSizeV4: 26, BlockSizeV6: 120}
	b, err := json.Marshal(p)
	require.NoError(t, err)
	require.JSONEq(t, `{"name":"blue","cidrs":["10.0.0.0/24","fd00::/64"],"blockSizeV4":26,"blockSizeV6":120}`, string(b))

	var got allocator.Pool
	require.NoError(t, json.Unmarshal(b, &got))
	require.Equal(t, p, got)

	// An empty CIDR decodes to the zero Prefix; Validate must catch it.
	require.NoError(t, json.Unmarshal([]byte(`{"name":"x","cidrs":[""],"blockSizeV4":26}`), &got))
	require.ErrorIs(t, got.Validate(), allocator.ErrInvalidPool)
}

func TestPoolNoPanicOnInvalid(t *testing.T) {
	// The accessors must answer, not panic, for pools that fail Validate.
	pools := []allocator.Pool{
		{},
		{Name: "x", CIDRs: []netip.Prefix{{}}},
		{Name: "x", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 8},
		{Name: "x", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: -5},
		{Name: "x", CIDRs: pfxs("10.0.0.0/24"), BlockSizeV4: 99},
		{Name: "x", CIDRs: pfxs("10.0.0.7/24"), BlockSizeV4: 26},
		{Name: "x", CIDRs: pfxs("::/0"), BlockSizeV6: 1},
		{Name: "x", CIDRs: pfxs("::/0", "::/0"), BlockSizeV6: 128},
	}
	for i, p := range pools {
		t.Run(strings.Repeat("x", i+1), func(t *testing.T) {
			_ = p.Validate()
			for _, f := range []allocator.Family{0, allocator.IPv4, allocator.IPv6} {
				_ = p.BlockSize(f)
				_ = p.BlockCount(f)
				_ = p.CIDRsOf(f)
			}
			for _, a := range []netip.Addr{{}, addr("10.0.0.7"), addr("::"), addr("::1")} {
				_ = p.Contains(a)
				if b, ok := p.BlockFor(a); ok {
					_, _ = p.CIDRFor(b)
					_ = p.Excluded(b)
					_, _ = allocator.NewBlockAlloc(p, b)
				}
			}
			_ = p.Families()
		})
	}
	require.Equal(t, uint64(math.MaxUint64), pools[7].BlockCount(allocator.IPv6))
}
