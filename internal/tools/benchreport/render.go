package benchreport

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// Machine describes where the figures were measured.
type Machine struct {
	CPU, Kernel, Go string
	CPUs            int
	Versions        []string // module versions that matter (etcd, ebpf, netlink, cni)
	When            string
}

// WriteJSON writes the figures as a JSON list.
func WriteJSON(w io.Writer, figs []Figure) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(figs)
}

// Plot is one plot of the report: drawn into File (a path relative to
// the Markdown report), or, when File is empty, not drawn for Missing.
type Plot struct {
	Title, File, Caption, Missing string
}

// WriteMarkdown writes the report: the machine, the commands, every
// figure beside its baseline, the plots, and what was not measured.
func WriteMarkdown(w io.Writer, m Machine, commands []string, figs []Figure, missing []string, plots []Plot) error {
	var b strings.Builder
	b.WriteString("# Benchmarks\n\n")
	b.WriteString("Written by `make bench` (or `make bench-quick`, smaller) from the output of its commands; do not edit by hand. ")
	b.WriteString("Every figure stands beside a baseline measured in the same run, on the same machine; a ratio below 1 is kvipam faster or cheaper than its baseline.\n\n")
	fmt.Fprintf(&b, "- When: %s\n- Machine: %s, %d CPUs, Linux %s\n- Go: %s\n", m.When, m.CPU, m.CPUs, m.Kernel, m.Go)
	for _, v := range m.Versions {
		fmt.Fprintf(&b, "- %s\n", v)
	}
	b.WriteString("\n## Figures\n\n| name | value | baseline | ratio | the baseline is |\n|---|---|---|---|---|\n")
	for _, f := range figs {
		value := num(f.Value)
		if f.Value == 0 {
			value = "0"
		}
		fmt.Fprintf(&b, "| `%s` | %s %s | %s | %s | %s |\n", f.Name, value, f.Unit, num(f.Baseline), num(f.Ratio), BaselineOf(f.Name))
	}
	var notDrawn []Plot
	for i, p := range plots {
		if i == 0 {
			b.WriteString("\n## Plots\n\nDrawn from the benchmarks' raw samples (bench-out/samples, written when " + SamplesEnv + " is set).\n")
		}
		if p.File == "" {
			notDrawn = append(notDrawn, p)
			continue
		}
		fmt.Fprintf(&b, "\n### %s\n\n![%s](%s)\n\n%s\n", p.Title, p.Title, p.File, p.Caption)
	}
	if len(missing) > 0 || len(NotMeasured) > 0 || len(notDrawn) > 0 {
		b.WriteString("\n## Not in this run\n\n")
		for _, p := range notDrawn {
			fmt.Fprintf(&b, "- plot %q: not measured: %s\n", p.Title, p.Missing)
		}
		for _, n := range missing {
			fmt.Fprintf(&b, "- `%s`: its benchmark's output is missing from this run\n", n)
		}
		for _, n := range NotMeasured {
			fmt.Fprintf(&b, "- `%s`: no benchmark measures it yet\n", n)
		}
	}
	b.WriteString("\n## Commands\n\n```\n")
	for _, c := range commands {
		b.WriteString(c + "\n")
	}
	b.WriteString("```\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func num(x float64) string {
	switch {
	case x == 0:
		return "-"
	case x >= 100:
		return fmt.Sprintf("%.0f", x)
	case x >= 1:
		return fmt.Sprintf("%.2f", x)
	default:
		return fmt.Sprintf("%.3g", x)
	}
}
