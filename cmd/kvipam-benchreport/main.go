// Command kvipam-benchreport writes docs/BENCHMARKS.md and
// docs/benchmarks.json from the output files of `make bench`: one file
// per command (<name>.txt, go test -bench output) and commands.txt, and
// the plots (SVG) from the benchmarks' raw samples (<in>/samples).
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
	"github.com/kvipam/kvipam/internal/tools/benchreport/plots"
)

func main() {
	in := flag.String("in", "bench-out", "directory of the bench commands' output")
	jsonOut := flag.String("json", "docs/benchmarks.json", "JSON report to write")
	mdOut := flag.String("md", "docs/BENCHMARKS.md", "Markdown report to write")
	svgOut := flag.String("svg", "docs/plots", "directory of the plots (SVG) to write, its *.svg replaced; empty draws none")
	flag.Parse()
	if err := run(*in, *jsonOut, *mdOut, *svgOut); err != nil {
		fmt.Fprintln(os.Stderr, "kvipam-benchreport:", err)
		os.Exit(1)
	}
}

func run(in, jsonOut, mdOut, svgOut string) error {
	files, err := filepath.Glob(filepath.Join(in, "*.txt"))
	if err != nil {
		return err
	}
	byFile := map[string][]benchreport.Result{}
	var commands []string
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".txt")
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		if name == "commands" {
			commands = strings.Split(strings.TrimSpace(string(b)), "\n")
			continue
		}
		rs, err := benchreport.Parse(bytes.NewReader(b))
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		byFile[name] = rs
	}
	figs, missing := benchreport.Figures(byFile)
	if len(figs) == 0 {
		return fmt.Errorf("no figures in %s: run make bench first", in)
	}
	var drawn []benchreport.Plot
	if svgOut != "" {
		set, err := benchreport.ReadSamples(filepath.Join(in, "samples"))
		if err != nil {
			return err
		}
		if drawn, err = plots.Write(svgOut, filepath.Dir(mdOut), set); err != nil {
			return err
		}
	}
	var js, md bytes.Buffer
	if err := benchreport.WriteJSON(&js, figs); err != nil {
		return err
	}
	if err := benchreport.WriteMarkdown(&md, machine(), commands, figs, missing, drawn); err != nil {
		return err
	}
	if err := os.WriteFile(jsonOut, js.Bytes(), 0o644); err != nil {
		return err
	}
	return os.WriteFile(mdOut, md.Bytes(), 0o644)
}

// machine describes this host and the module versions that matter.
func machine() benchreport.Machine {
	m := benchreport.Machine{CPUs: runtime.NumCPU(), Go: runtime.Version(), When: time.Now().UTC().Format(time.RFC3339)}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("go.mod"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			for _, mod := range []string{"go.etcd.io/etcd/client/v3 ", "go.etcd.io/etcd/server/v3 ", "github.com/cilium/ebpf ", "github.com/vishvananda/netlink ", "github.com/containernetworking/cni "} {
				if strings.HasPrefix(strings.TrimSpace(line), mod) {
					m.Versions = append(m.Versions, strings.TrimSpace(line))
				}
			}
		}
	}
	return m
}
