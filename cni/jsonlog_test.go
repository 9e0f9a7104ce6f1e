package cni

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
)

// lines splits a log into its JSON objects, failing on a line that is not one.
func lines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var ls []map[string]any
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &m), "line %q", l)
		ls = append(ls, m)
	}
	return ls
}

type textErr struct{}

func (textErr) Error() string                { return "as error" }
func (textErr) MarshalText() ([]byte, error) { return []byte("as text"), nil }

func TestJSONLogger(t *testing.T) {
	at := time.Date(2026, 12, 3, 9, 30, 0, 123456789, time.UTC)
	for _, tc := range []struct {
		name string
		log  func(l logger)
		want string
	}{
		{name: "message and pairs", log: func(l logger) {
			l.Info("added", "owner", "pods/c1/eth0", "ips", []string{"10.0.0.5/32"}, "took", 1500*time.Microsecond)
		}, want: `{"@level":"info","@message":"added","@module":"kvipam","@timestamp":"2026-12-03T09:30:00.123456Z","owner":"pods/c1/eth0","ips":["10.0.0.5/32"],"took":1500000}`},
		{name: "error is its message", log: func(l logger) {
			l.Warn("release queued", "error", errors.New(`no "agent"`), "n", 3)
		}, want: `{"@level":"warn","@message":"release queued","@module":"kvipam","@timestamp":"2026-12-03T09:30:00.123456Z","error":"no \"agent\"","n":3}`},
		{name: "error that encodes itself", log: func(l logger) {
			l.Info("x", "error", textErr{})
		}, want: `{"@level":"info","@message":"x","@module":"kvipam","@timestamp":"2026-12-03T09:30:00.123456Z","error":"as text"}`},
		{name: "odd pairs, key not a string, escaping", log: func(l logger) {
			l.Debug("a <b>\n", 7, netip.MustParseAddr("10.0.0.1"), "dangling")
		}, want: `{"@level":"debug","@message":"a \u003cb\u003e\n","@module":"kvipam","@timestamp":"2026-12-03T09:30:00.123456Z","7":"10.0.0.1","EXTRA_VALUE_AT_END":"dangling"}`},
		{name: "value with no JSON", log: func(l logger) {
			l.Info("x", "ch", make(chan int), "f", 1.5)
		}, want: `{"@level":"info","@message":"x","@module":"kvipam","@timestamp":"2026-12-03T09:30:00.123456Z","ch":"` + "%CHAN%" + `","f":1.5}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			l := newJSONLogger("kvipam", levelDebug, &buf)
			l.now = func() time.Time { return at }
			tc.log(l)
			got := buf.String()
			require.True(t, strings.HasSuffix(got, "}\n"), got)
			if strings.Contains(tc.want, "%CHAN%") {
				require.Regexp(t, `"ch":"0x[0-9a-f]+"`, got)
				return
			}
			require.Equal(t, tc.want+"\n", got)
			lines(t, got)
		})
	}
}

func TestJSONLoggerLevels(t *testing.T) {
	for _, tc := range []struct {
		level string
		want  []string
	}{
		{"trace", []string{"debug", "info", "warn"}},
		{"debug", []string{"debug", "info", "warn"}},
		{"INFO", []string{"info", "warn"}},
		{"warn", []string{"warn"}},
		{"error", nil},
		{"off", nil},
		{"", nil},
	} {
		t.Run(tc.level, func(t *testing.T) {
			var buf bytes.Buffer
			l, done := newLogger("kvipam-ipam", &Config{LogLevel: tc.level}, &buf)
			defer done()
			l.Debug("d")
			l.Info("i")
			l.Warn("w")
			var got []string
			for _, m := range lines(t, buf.String()) {
				require.Equal(t, "kvipam-ipam", m["@module"])
				got = append(got, m["@level"].(string))
			}
			require.Equal(t, tc.want, got)
		})
	}
}

// TestJSONLoggerFile: with logFile, lines are appended to it; each line is
// whole, however many goroutines log at once.
func TestJSONLoggerFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "plugin.log")
	require.NoError(t, os.WriteFile(file, []byte(`{"@message":"before"}`+"\n"), 0o600))
	var stderr bytes.Buffer
	l, done := newLogger("kvipam", &Config{LogLevel: "info", LogFile: file}, &stderr)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 50 {
				l.Info("line", "g", i, "j", j, "pad", strings.Repeat("x", 300))
			}
		}()
	}
	wg.Wait()
	done()
	require.Empty(t, stderr.String())
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	ls := lines(t, string(b))
	require.Len(t, ls, 1+8*50)
	require.Equal(t, "before", ls[0]["@message"])
}

// TestJSONLoggerAsHclog: a line has the fields and values of the line
// hclog's JSON format wrote for the same call (the plugin's log before).
func TestJSONLoggerAsHclog(t *testing.T) {
	var ours, theirs bytes.Buffer
	l := newJSONLogger("kvipam", levelDebug, &ours)
	h := hclog.New(&hclog.LoggerOptions{Name: "kvipam", Level: hclog.Debug, Output: &theirs, JSONFormat: true})
	call := func(log logger) {
		log.Info("added", "owner", "pods/c1/eth0", "pod", "ns/p", "ips", []netip.Prefix{netip.MustParsePrefix("10.0.0.5/32")}, "took", 3*time.Millisecond, "error", errors.New("boom"), "queued", true)
		log.Warn("odd", "k")
		log.Debug("html <&>", "n", nil)
	}
	call(l)
	call(h)
	a, b := lines(t, ours.String()), lines(t, theirs.String())
	require.Len(t, a, 3)
	for i := range a {
		require.NotEmpty(t, a[i]["@timestamp"])
		_, err := time.Parse(timeFormat, a[i]["@timestamp"].(string))
		require.NoError(t, err)
		delete(a[i], "@timestamp")
		delete(b[i], "@timestamp")
	}
	require.Equal(t, b, a)
}
