package plots

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"

	"github.com/kvipam/kvipam/internal/tools/benchreport"
)

// fallbackWidth is how much wider than the font the SVG names (Liberation
// Serif, whose metrics place the text) a viewer's font may draw a label:
// one without Liberation falls back to a wider serif or sans.
const fallbackWidth = 1.25

// TestLegendsReadable draws every plot of the fixture (two claim storms:
// the longest labels) and reads each SVG back: every legend label, at
// the width a viewer's fallback font may give it, ends inside the
// picture and stays off the plot area (the rectangle the grid spans),
// where it would cover the curves.
func TestLegendsReadable(t *testing.T) {
	set, err := benchreport.ReadSamples("testdata/samples")
	require.NoError(t, err)
	dir := t.TempDir()
	drawn, err := Write(dir, dir, set)
	require.NoError(t, err)
	labels := map[string]bool{}
	for _, f := range figures(set) {
		for _, l := range f.lines {
			labels[l.label] = true
		}
	}
	for _, p := range drawn {
		require.NotEmpty(t, p.File, p.Title)
		svg := readSVG(t, filepath.Join(dir, p.File))
		found := 0
		for _, tx := range svg.texts {
			if !labels[tx.s] {
				continue
			}
			found++
			sty := text.Style{Font: font.From(plot.DefaultFont, vg.Length(tx.size)), Handler: plot.DefaultTextHandler}
			w := float64(sty.Rectangle(tx.s).Max.X) * fallbackWidth
			require.LessOrEqual(t, tx.x+w, svg.width, "%s: legend %q runs past the picture's right edge (%.1f > %.1f)", p.File, tx.s, tx.x+w, svg.width)
			require.GreaterOrEqual(t, tx.x, 0.0, "%s: legend %q starts left of the picture", p.File, tx.s)
			// The text's box, in the plot's coordinates (y up): from its
			// descent below the baseline to its size above.
			x0, x1, y0, y1 := tx.x, tx.x+w, tx.y-0.25*tx.size, tx.y+tx.size
			area := svg.area
			overlaps := x0 < area.x1 && x1 > area.x0 && y0 < area.y1 && y1 > area.y0
			require.False(t, overlaps, "%s: legend %q (x %.1f-%.1f, y %.1f-%.1f) covers the plot area (x %.1f-%.1f, y %.1f-%.1f)",
				p.File, tx.s, x0, x1, y0, y1, area.x0, area.x1, area.y0, area.y1)
		}
		require.NotZero(t, found, "%s: no legend label found", p.File)
	}
}

// svgPlot is what the test reads back of a plot's SVG: its width, its
// texts, and the plot area the grid spans (all in points, y up).
type svgPlot struct {
	width float64
	texts []svgText
	area  struct{ x0, x1, y0, y1 float64 }
}

type svgText struct {
	s          string
	x, y, size float64
}

var (
	fontSize = regexp.MustCompile(`font-size:([0-9.]+)px`)
	pathNums = regexp.MustCompile(`-?[0-9.]+`)
)

// readSVG parses what gonum's SVG canvas writes: a group flipped to y up,
// texts flipped back (y negated), the grid as gray paths.
func readSVG(t *testing.T, path string) svgPlot {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		ViewBox string `xml:"viewBox,attr"`
		G       struct {
			Texts []struct {
				X     float64 `xml:"x,attr"`
				Y     float64 `xml:"y,attr"`
				Style string  `xml:"style,attr"`
				Text  string  `xml:",chardata"`
			} `xml:"text"`
			Paths []struct {
				D     string `xml:"d,attr"`
				Style string `xml:"style,attr"`
			} `xml:"path"`
		} `xml:"g"`
	}
	require.NoError(t, xml.Unmarshal(b, &doc), path)
	vb := strings.Fields(doc.ViewBox)
	require.Len(t, vb, 4, "%s: viewBox", path)
	var out svgPlot
	out.width, err = strconv.ParseFloat(vb[2], 64)
	require.NoError(t, err)
	for _, tx := range doc.G.Texts {
		m := fontSize.FindStringSubmatch(tx.Style)
		require.NotNil(t, m, "%s: text %q has no font size", path, tx.Text)
		size, err := strconv.ParseFloat(m[1], 64)
		require.NoError(t, err)
		out.texts = append(out.texts, svgText{s: tx.Text, x: tx.X, y: -tx.Y, size: size})
	}
	first := true
	for _, p := range doc.G.Paths {
		if !strings.Contains(p.Style, "stroke:#808080") {
			continue
		}
		nums := pathNums.FindAllString(p.D, -1)
		for i := 0; i+1 < len(nums); i += 2 {
			x, err := strconv.ParseFloat(nums[i], 64)
			require.NoError(t, err)
			y, err := strconv.ParseFloat(nums[i+1], 64)
			require.NoError(t, err)
			if first {
				out.area.x0, out.area.x1, out.area.y0, out.area.y1 = x, x, y, y
				first = false
			}
			out.area.x0, out.area.x1 = min(out.area.x0, x), max(out.area.x1, x)
			out.area.y0, out.area.y1 = min(out.area.y0, y), max(out.area.y1, y)
		}
	}
	require.False(t, first, "%s: no grid found", path)
	return out
}
