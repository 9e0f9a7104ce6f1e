package main

import (
	"encoding/json"
	"fmt"
	"io"
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
