package plots

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// TestPlotsFromSamples: the fixture's sample files (testdata/samples)
// give every plot as a valid SVG file, named in the report; without the
// claim storm's file, that plot is listed as not measured.
func TestPlotsFromSamples(t *testing.T) {
	set, err := benchreport.ReadSamples("testdata/samples")
	require.NoError(t, err)
	require.Len(t, set.Samples, 6)
	require.Len(t, set.Storms, 2)

	docs := t.TempDir()
	dir := filepath.Join(docs, "plots")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stale.svg"), []byte("<svg/>"), 0o644))
	got, err := Write(dir, docs, set)
	require.NoError(t, err)
	files := map[string]bool{}
	for _, p := range got {
		require.NotEmpty(t, p.File, "%s: %s", p.Title, p.Missing)
		require.Contains(t, p.Caption, "Sources:")
		files[p.File] = true
		b, err := os.ReadFile(filepath.Join(docs, p.File))
		require.NoError(t, err)
		require.True(t, bytes.HasPrefix(b, []byte("<?xml")) || bytes.HasPrefix(b, []byte("<svg")), "%s starts %q", p.File, b[:min(len(b), 20)])
		require.Contains(t, string(b), "<svg")
		require.True(t, strings.HasSuffix(strings.TrimSpace(string(b)), "</svg>"), p.File)
	}
	require.Equal(t, map[string]bool{"plots/add-latency-cdf.svg": true, "plots/del-latency-cdf.svg": true,
		"plots/burst100-bpf.svg": true, "plots/k8s-burst100.svg": true, "plots/add-throughput.svg": true, "plots/claim-storm.svg": true,
		"plots/migration-cutover.svg": true, "plots/migration-unanswered.svg": true}, files)
	_, err = os.Stat(filepath.Join(dir, "stale.svg"))
	require.True(t, os.IsNotExist(err), "an earlier run's plots are replaced")

	// The routes line comes from BenchmarkAddDatapath when BenchmarkAddDel
	// ran on bpf only.
	add := latencyCDF(set, "add", "ADD")
	require.Len(t, add.lines, 3)
	require.Equal(t, "kvipam, routes datapath", add.lines[0].label)
	require.Equal(t, addDatapath, add.lines[0].source)
	require.Equal(t, "bridge + host-local", add.lines[2].label)
	// Throughput: 5 ADDs in 190.5 ms, 4 in 70 ms.
	tp := throughput(set)
	require.Len(t, tp.lines, 2)
	require.InDelta(t, 5/0.1905, tp.lines[0].xy[0].Y, 1e-9)
	require.InDelta(t, 50, tp.lines[0].xy[1].X, 1e-9)
	require.InDelta(t, 4/0.070, tp.lines[0].xy[1].Y, 1e-9)

	// The Kubernetes burst: a line per network, the pods Ready over time
	// in seconds, the mean of the rounds (10 samples of 2 rounds: 5 pods).
	k8s := k8sBursts(set)
	require.Len(t, k8s, 1)
	require.Equal(t, "k8s-burst100", k8s[0].name)
	var labels []string
	for _, l := range k8s[0].lines {
		labels = append(labels, l.label)
	}
	require.Equal(t, []string{"kvipam, bpf datapath", "kvipam, routes datapath", "bridge + host-local + portmap", "host network (the floor)"}, labels)
	kv := k8s[0].lines[0].xy
	require.InDelta(t, 5, kv[len(kv)-1].Y, 1e-9)
	require.InDelta(t, 3.1, kv[len(kv)-1].X, 1e-9)
	require.True(t, k8s[0].lines[2].dashed && k8s[0].lines[3].dashed && !k8s[0].lines[0].dashed)

	// Live migration: a line per routing and family, IPv6 dashed in its
	// IPv4 line's colour; the moves' distribution.
	mig := migrations(set)
	require.Len(t, mig, 2)
	require.Len(t, mig[0].lines, 2)
	require.Equal(t, "bgp, ipv4", mig[0].lines[0].label)
	require.True(t, mig[0].lines[1].dashed && mig[0].lines[1].color == mig[0].lines[0].color)
	cut := mig[0].lines[0].xy
	require.InDelta(t, 262.0, cut[len(cut)-1].X, 1e-9)
	require.InDelta(t, 1, cut[len(cut)-1].Y, 1e-9)
	require.Contains(t, mig[0].lines[0].source, "4 moves")

	set.Storms = nil
	got, err = Write(dir, docs, set)
	require.NoError(t, err)
	var md bytes.Buffer
	require.NoError(t, benchreport.WriteMarkdown(&md, benchreport.Machine{}, nil, nil, nil, got))
	require.Contains(t, md.String(), "![CNI ADD latency, one pod at a time](plots/add-latency-cdf.svg)")
	require.Contains(t, md.String(), `plot "Claim storm: nodes with their first block, over time": not measured: no claim storm samples`)
	_, err = os.Stat(filepath.Join(dir, "claim-storm.svg"))
	require.True(t, os.IsNotExist(err))
}

// TestNoSamples: a run without samples draws nothing and names every
// plot as not measured.
func TestNoSamples(t *testing.T) {
	set, err := benchreport.ReadSamples(filepath.Join(t.TempDir(), "missing"))
	require.NoError(t, err)
	got, err := Write(t.TempDir(), ".", set)
	require.NoError(t, err)
	require.Len(t, got, 8)
	for _, p := range got {
		require.Empty(t, p.File)
		require.NotEmpty(t, p.Missing, p.Title)
	}
}
