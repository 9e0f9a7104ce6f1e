package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/big"
	"strings"
	"text/tabwriter"
	"time"
)

// render writes v as indented JSON with -o json, or else calls table with
// a tab-separated writer that aligns columns, flushed when table returns.
func (a *app) render(w io.Writer, v any, table func(tw io.Writer)) error {
	if a.flags.output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(v); err != nil {
			return fmt.Errorf("write json: %w", err)
		}
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	table(tw)
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

// row writes one tab-separated table row.
func row(w io.Writer, cols ...any) {
	parts := make([]string, len(cols))
	for i, c := range cols {
		parts[i] = cell(c)
	}
	fmt.Fprintln(w, strings.Join(parts, "\t"))
}

func cell(c any) string {
	switch v := c.(type) {
	case string:
		if v == "" {
			return "-"
		}
		return v
	case time.Time:
		if v.IsZero() {
			return "-"
		}
		return v.UTC().Format(time.RFC3339)
	case fmt.Stringer:
		return v.String()
	default:
		return fmt.Sprint(v)
	}
}

// addressCount prints a count of addresses: exactly in decimal below
// 2^32 (every IPv4 count), else as a power of two, m*2^k with m as small
// as it can be, give or take a difference under 2^16 ("2^64-1" for a /64
// less its anycast address), so an IPv6 size reads at a glance. Failing
// that, approximately ("~2^63.4"); JSON keeps the exact number.
func addressCount(n *big.Int) string {
	if n == nil {
		return "-"
	}
	if n.Sign() < 0 || n.BitLen() <= 32 {
		return n.String()
	}
	near := new(big.Int).Lsh(big.NewInt(1), 16)
	for k := n.BitLen(); k >= 32; k-- {
		p := new(big.Int).Lsh(big.NewInt(1), uint(k))
		half := new(big.Int).Rsh(p, 1)
		m := new(big.Int).Div(new(big.Int).Add(n, half), p) // n/2^k, rounded
		d := new(big.Int).Sub(n, new(big.Int).Mul(m, p))
		if m.Sign() == 0 || new(big.Int).Abs(d).Cmp(near) >= 0 {
			continue
		}
		s := fmt.Sprintf("2^%d", k)
		if !m.IsInt64() || m.Int64() != 1 {
			s = m.String() + "*" + s
		}
		switch d.Sign() {
		case 1:
			s += "+" + d.String()
		case -1:
			s += d.String()
		}
		return s
	}
	f, _ := new(big.Float).SetInt(n).Float64()
	return fmt.Sprintf("~2^%.1f", math.Log2(f))
}

// uintCount is addressCount of a uint64 (block counts, reserved ranges).
func uintCount(v uint64) string { return addressCount(new(big.Int).SetUint64(v)) }
