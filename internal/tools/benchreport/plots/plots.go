// Package plots draws the benchmark report's plots, as SVG with
// gonum.org/v1/plot, from the benchmarks' raw samples
// (benchreport.Samples, benchreport.Storm).
package plots

import (
	"cmp"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// The benchmarks the plots are drawn from.
const (
	addDel      = "BenchmarkAddDel/concurrency=1"
	addDatapath = "BenchmarkAddDatapath"
	burst100    = "BenchmarkBurst100"
	k8sBurst    = "BenchmarkK8sBurst/burst="
)

// datapaths are the kvipam agent's datapaths, in the plots' order.
var datapaths = []string{"routes", "bpf"}

// line is one line of a plot: its label, where it comes from, and its
// points.
type line struct {
	label, source string
	xy            plotter.XYs
	dashed        bool
	// sameColor draws the line in the previous line's colour (a
	// baseline beside its measure).
	sameColor bool
	color     int
}

// figure is one plot before drawing.
type figure struct {
	name, title, xLabel, yLabel string
	logX, points                bool
	caption                     string
	lines                       []line
	missing                     string // why there are no lines
}

// Write draws every plot into dir (its *.svg files replaced) and returns
// them for the report, with File relative to relTo (the Markdown
// report's directory); a plot without samples has no File and says why.
func Write(dir, relTo string, set benchreport.SampleSet) ([]benchreport.Plot, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	old, err := filepath.Glob(filepath.Join(dir, "*.svg"))
	if err != nil {
		return nil, err
	}
	for _, f := range old {
		if err := os.Remove(f); err != nil {
			return nil, err
		}
	}
	var out []benchreport.Plot
	for _, f := range figures(set) {
		p := benchreport.Plot{Title: f.title, Missing: f.missing}
		if len(f.lines) > 0 {
			path := filepath.Join(dir, f.name+".svg")
			if err := f.draw(path); err != nil {
				return nil, fmt.Errorf("plot %s: %w", f.name, err)
			}
			if p.File, err = filepath.Rel(relTo, path); err != nil {
				return nil, err
			}
			p.File, p.Caption = filepath.ToSlash(p.File), f.caption+" "+sources(f.lines)
		}
		out = append(out, p)
	}
	return out, nil
}

// figures are the report's plots, drawn or not.
func figures(set benchreport.SampleSet) []figure {
	figs := []figure{latencyCDF(set, "add", "ADD"), latencyCDF(set, "del", "DEL")}
	figs = append(figs, bursts(set)...)
	figs = append(figs, k8sBursts(set)...)
	figs = append(figs, migrations(set)...)
	return append(figs, throughput(set), storm(set))
}

// latencyCDF is the distribution of one operation's latency, one pod at
// a time: kvipam on each datapath (from BenchmarkAddDel run on it, else
// from BenchmarkAddDatapath) and bridge + host-local.
func latencyCDF(set benchreport.SampleSet, op, title string) figure {
	f := figure{name: op + "-latency-cdf", title: "CNI " + title + " latency, one pod at a time", logX: true,
		xLabel: title + " latency (ms, log scale)", yLabel: "fraction of " + title + "s at most this long",
		caption: "The distribution of one " + title + "'s latency through libcni, plugin processes included.",
		missing: "no BenchmarkAddDel or BenchmarkAddDatapath samples"}
	for _, dp := range datapaths {
		label := "kvipam, " + dp + " datapath"
		if s, ok := set.Find(addDel, dp); ok && len(s.SeriesMS["kvipam-"+op]) > 0 {
			f.add(line{label: label, source: addDel + " (" + dp + ")", xy: cdf(s.SeriesMS["kvipam-"+op])})
		} else if s, ok := set.Find(addDatapath, ""); ok && len(s.SeriesMS[dp+"-"+op]) > 0 {
			f.add(line{label: label, source: addDatapath, xy: cdf(s.SeriesMS[dp+"-"+op])})
		}
	}
	if s, ok := set.Find(addDel, ""); ok && len(s.SeriesMS["bridge-"+op]) > 0 {
		f.add(line{label: "bridge + host-local", source: addDel + " (" + s.Datapath + " run)", xy: cdf(s.SeriesMS["bridge-"+op]), dashed: true})
	}
	return f
}

// bursts are the completion of a burst of 100 pods over time, one plot
// per datapath BenchmarkBurst100 ran with.
func bursts(set benchreport.SampleSet) []figure {
	var figs []figure
	for _, s := range set.Samples {
		if s.Bench != burst100 {
			continue
		}
		runs, name := max(s.Runs, 1), "burst100"
		if s.Datapath != "" {
			name += "-" + s.Datapath
		}
		f := figure{name: name, title: "100 pods added at once, kvipam on the " + s.Datapath + " datapath",
			xLabel: "time since the burst's start (ms)", yLabel: "pods added (mean over bursts)",
			caption: fmt.Sprintf("Pods whose ADD has completed, against the time since 100 ADDs were started at once; the mean of %s. The loopback plugin is the exec floor, what any plugin costs the runtime.", plural(runs, "burst"))}
		for _, name := range []string{"kvipam", "bridge", "floor"} {
			if ms := s.SeriesMS[name]; len(ms) > 0 {
				f.add(line{label: burstLabels[name], source: fmt.Sprintf("%s (%s)", burst100, s.Datapath), xy: completion(ms, float64(runs), 1), dashed: name != "kvipam"})
			}
		}
		figs = append(figs, f)
	}
	if len(figs) == 0 {
		figs = append(figs, figure{name: "burst100", title: "100 pods added at once", missing: "no BenchmarkBurst100 samples"})
	}
	return figs
}

// k8sBursts are the pods of a burst Ready over time, through a real
// kubelet, one plot per burst size BenchmarkK8sBurst ran.
func k8sBursts(set benchreport.SampleSet) []figure {
	var figs []figure
	for _, s := range set.Samples {
		size, ok := strings.CutPrefix(s.Bench, k8sBurst)
		if !ok {
			continue
		}
		runs := max(s.Runs, 1)
		f := figure{name: "k8s-burst" + size, title: size + " pods created at once on one kubelet",
			xLabel: "time since the pods' creation (s)", yLabel: "pods Ready (mean over rounds)",
			caption: fmt.Sprintf("Pods Ready, against the time since %s pods were created on one node in one request (a real kubelet and containerd); the mean of %s, the networks interleaved. Host-network pods set up no network: they are the floor.", size, plural(runs, "round"))}
		for _, net := range []string{"kvipam", "kvipam-routes", "bridge", "hostnet"} {
			if ms := s.SeriesMS[net]; len(ms) > 0 {
				f.add(line{label: k8sLabels[net], source: s.Bench, xy: completion(ms, float64(runs), 1000), dashed: net == "bridge" || net == "hostnet"})
			}
		}
		figs = append(figs, f)
	}
	if len(figs) == 0 {
		figs = append(figs, figure{name: "k8s-burst", title: "Pods created at once on one kubelet", missing: "no BenchmarkK8sBurst samples (e2e/k8s, as root)"})
	}
	return figs
}

var k8sLabels = map[string]string{"kvipam": "kvipam, bpf datapath", "kvipam-routes": "kvipam, routes datapath",
	"bridge": "bridge + host-local + portmap", "hostnet": "host network (the floor)"}

var burstLabels = map[string]string{"kvipam": "kvipam", "bridge": "bridge + host-local", "floor": "loopback (the floor)"}

// throughput is ADDs per second against the number of pods set up at
// once (BenchmarkAddDel): each worker runs ADD then DEL, so this is the
// rate of pods added and deleted.
func throughput(set benchreport.SampleSet) figure {
	f := figure{name: "add-throughput", title: "Pods added and deleted per second, against concurrency", points: true,
		xLabel: "pods set up at once", yLabel: "ADDs per second (each followed by its DEL)",
		caption: "ADDs completed per second of wall-clock time, with each worker running ADD then DEL.",
		missing: "no BenchmarkAddDel samples"}
	bridge := line{label: "bridge + host-local", dashed: true}
	seen := map[int]bool{}
	for _, dp := range datapaths {
		kv := line{label: "kvipam, " + dp + " datapath"}
		for _, s := range set.Samples {
			if s.Datapath != dp || s.Concurrency == 0 || !isAddDel(s.Bench) {
				continue
			}
			if r := rate(s, "kvipam"); r > 0 {
				kv.xy = append(kv.xy, plotter.XY{X: float64(s.Concurrency), Y: r})
				kv.source = "BenchmarkAddDel (" + dp + ")"
			}
			if r := rate(s, "bridge"); r > 0 && !seen[s.Concurrency] {
				seen[s.Concurrency] = true
				bridge.xy = append(bridge.xy, plotter.XY{X: float64(s.Concurrency), Y: r})
				bridge.source = "BenchmarkAddDel (" + dp + " run)"
			}
		}
		if len(kv.xy) > 0 {
			f.add(kv)
		}
	}
	if len(bridge.xy) > 0 {
		f.add(bridge)
	}
	for i := range f.lines {
		slices.SortFunc(f.lines[i].xy, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
	}
	return f
}

func isAddDel(bench string) bool { return strings.HasPrefix(bench, "BenchmarkAddDel/") }

// rate is a plugin's ADDs per second in s.
func rate(s benchreport.Samples, plugin string) float64 {
	wall := s.WallMS[plugin]
	if wall <= 0 {
		return 0
	}
	return float64(len(s.SeriesMS[plugin+"-add"])) / (wall / 1000)
}

// storm is the claim storm's completion over time, one line per number
// of nodes (benchreport.Storm files).
func storm(set benchreport.SampleSet) figure {
	f := figure{name: "claim-storm", title: "Claim storm: nodes with their first block, over time",
		xLabel: "time since the storm's start (s)", yLabel: "nodes whose claim completed",
		caption: "Every node claims its first block at once; a dashed line is the baseline, as many bare create-if-absent transactions at once.",
		missing: "no claim storm samples, bench-out/samples/storm-*.json"}
	for _, s := range set.Storms {
		src := fmt.Sprintf("BenchmarkClaimStorm (%d nodes)", s.Nodes)
		if len(s.CompletionsMS) > 0 {
			f.add(line{label: fmt.Sprintf("%d nodes", s.Nodes), source: src, xy: completion(s.CompletionsMS, 1, 1000)})
		}
		if len(s.BaselineCompletionsMS) > 0 {
			f.add(line{label: fmt.Sprintf("%d nodes, baseline", s.Nodes), source: src, xy: completion(s.BaselineCompletionsMS, 1, 1000), dashed: true, sameColor: true})
		}
	}
	return f
}

func (f *figure) add(l line) {
	l.color = len(f.lines)
	if l.sameColor && len(f.lines) > 0 {
		l.color = f.lines[len(f.lines)-1].color
	}
	f.lines, f.missing = append(f.lines, l), ""
}

// cdf is the empirical distribution of ms: at each sample, the fraction
// of samples at most that large (drawn as steps).
func cdf(ms []float64) plotter.XYs {
	s := slices.Clone(ms)
	slices.Sort(s)
	xy := plotter.XYs{{X: s[0], Y: 0}}
	for i, v := range s {
		xy = append(xy, plotter.XY{X: v, Y: float64(i+1) / float64(len(s))})
	}
	return xy
}

// completion counts completions over time: at each completion time (ms,
// divided by unit), how many completed by then, divided by runs.
func completion(ms []float64, runs, unit float64) plotter.XYs {
	s := slices.Clone(ms)
	slices.Sort(s)
	xy := plotter.XYs{{X: 0, Y: 0}}
	for i, v := range s {
		xy = append(xy, plotter.XY{X: v / unit, Y: float64(i+1) / runs})
	}
	return xy
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// sources says where the lines come from.
func sources(lines []line) string {
	s := "Sources:"
	for i, l := range lines {
		if i > 0 {
			s += ";"
		}
		s += " " + l.label + " from " + l.source
	}
	return s + "."
}

// draw writes f as an SVG file.
func (f figure) draw(path string) error {
	p := plot.New()
	p.Title.Text = f.title
	p.X.Label.Text, p.Y.Label.Text = f.xLabel, f.yLabel
	// The legend goes in a strip of its own under the plot, one line per
	// entry from the left edge: it covers no curve, and the picture's
	// width leaves room for a viewer whose font is wider than the one
	// its text was measured in (TestLegendsReadable).
	legend := plot.NewLegend()
	legend.Top, legend.Left = true, true
	legend.XOffs, legend.Padding = legendMargin, vg.Points(2)
	p.Add(plotter.NewGrid())
	if f.logX {
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, logTicks{}
	}
	var xs []plot.Tick
	for _, l := range f.lines {
		for _, pt := range l.xy {
			xs = append(xs, plot.Tick{Value: pt.X, Label: strconv.FormatFloat(pt.X, 'g', -1, 64)})
		}
		ln, err := plotter.NewLine(l.xy)
		if err != nil {
			return err
		}
		ln.Color, ln.Width = plotutil.Color(l.color), vg.Points(1.5)
		if !f.points {
			ln.StepStyle = plotter.PostStep
		}
		if l.dashed {
			ln.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
		}
		p.Add(ln)
		legend.Add(l.label, ln)
		if f.points {
			sc, err := plotter.NewScatter(l.xy)
			if err != nil {
				return err
			}
			sc.Color, sc.Shape = plotutil.Color(l.color), plotutil.Shape(l.color)
			p.Add(sc)
		}
	}
	p.Y.Min = 0
	switch {
	case f.logX: // a margin of a tenth of a decade
		p.X.Min, p.X.Max = p.X.Min/1.25, p.X.Max*1.25
	case f.points: // ticks at the measured points only
		slices.SortFunc(xs, func(a, b plot.Tick) int { return cmp.Compare(a.Value, b.Value) })
		p.X.Tick.Marker = plot.ConstantTicks(slices.CompactFunc(xs, func(a, b plot.Tick) bool { return a.Value == b.Value }))
		p.X.Min, p.X.Max = 0, p.X.Max*1.05
	default:
		p.X.Max *= 1.05
		p.X.Tick.Marker = plainTicks{}
	}
	p.Y.Tick.Marker = plainTicks{}
	return save(p, legend, len(f.lines), path)
}

// The picture: a plot of plotWidth by plotHeight, and under it the
// legend's strip, legendMargin from the left and bottom edges.
const (
	plotWidth    = 16 * vg.Centimeter
	plotHeight   = 10 * vg.Centimeter
	legendMargin = vg.Length(0.3 * vg.Centimeter)
)

// save draws p above its legend of n entries and writes them as an SVG
// file.
func save(p *plot.Plot, legend plot.Legend, n int, path string) error {
	row := legend.TextStyle.Rectangle("Xg").Max.Y + legend.Padding
	strip := vg.Length(n)*row + 2*legendMargin
	c := vgsvg.New(plotWidth, plotHeight+strip)
	dc := draw.New(c)
	p.Draw(draw.Crop(dc, 0, 0, strip, 0))
	legend.Draw(draw.Crop(dc, 0, 0, legendMargin, -(plotHeight + legendMargin)))
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(out); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}

// plainTicks are plot.DefaultTicks labelled without trailing zeros
// (2500, not 2500.00).
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(lo, hi)
	for i, t := range ticks {
		if t.Label != "" {
			ticks[i].Label = strconv.FormatFloat(t.Value, 'g', 6, 64)
		}
	}
	return ticks
}

// logTicks label 1, 2 and 5 times each power of ten (plot.LogTicks
// labels only the powers), or every tick on an axis of less than a decade.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	all := hi/lo < 10
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		for m := 1; m < 10; m++ {
			v := float64(m) * math.Pow10(int(e))
			if v < lo || v > hi {
				continue
			}
			t := plot.Tick{Value: v}
			if all || m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', 3, 64)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}
