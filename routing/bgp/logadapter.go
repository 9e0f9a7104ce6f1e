package bgp

import (
	"github.com/hashicorp/go-hclog"
	gobgplog "github.com/osrg/gobgp/v3/pkg/log"
)

// logAdapter sends GoBGP's logs to hclog. With s, it first shows each
// event to s, which keeps why each session is not established and warns
// of it itself (rate-limited): the events s takes go to hclog at debug
// level only. GoBGP is then asked for debug events whatever hclog's level,
// as it reports a failed connection only at debug level.
type logAdapter struct {
	l hclog.Logger
	s *sessions
}

// log sends an event GoBGP logs at lvl to hclog, at debug level if s took it.
func (a logAdapter) log(lvl hclog.Level, msg string, f gobgplog.Fields) {
	if a.s != nil && a.s.observe(msg, f) {
		lvl = hclog.Debug
	}
	a.l.Log(lvl, msg, fields(f)...)
}

func fields(f gobgplog.Fields) []any {
	out := make([]any, 0, 2*len(f))
	for k, v := range f {
		out = append(out, k, v)
	}
	return out
}

func (a logAdapter) Panic(msg string, f gobgplog.Fields) { a.log(hclog.Error, msg, f) }
func (a logAdapter) Fatal(msg string, f gobgplog.Fields) { a.log(hclog.Error, msg, f) }
func (a logAdapter) Error(msg string, f gobgplog.Fields) { a.log(hclog.Error, msg, f) }
func (a logAdapter) Warn(msg string, f gobgplog.Fields)  { a.log(hclog.Warn, msg, f) }
func (a logAdapter) Info(msg string, f gobgplog.Fields)  { a.log(hclog.Info, msg, f) }
func (a logAdapter) Debug(msg string, f gobgplog.Fields) { a.log(hclog.Debug, msg, f) }
func (a logAdapter) SetLevel(gobgplog.LogLevel)          {}
func (a logAdapter) GetLevel() gobgplog.LogLevel {
	switch {
	case a.s != nil:
		return gobgplog.DebugLevel
	case a.l.IsTrace(), a.l.IsDebug():
		return gobgplog.DebugLevel
	case a.l.IsInfo():
		return gobgplog.InfoLevel
	case a.l.IsWarn():
		return gobgplog.WarnLevel
	}
	return gobgplog.ErrorLevel
}
