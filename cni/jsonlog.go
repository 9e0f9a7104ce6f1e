package cni

import (
	"encoding"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// level is a log line's severity; a logger writes the lines at its level
// and above.
type level int

const (
	levelTrace level = iota
	levelDebug
	levelInfo
	levelWarn
	levelError
	levelOff
)

var levelNames = [...]string{"trace", "debug", "info", "warn", "error", "off"}

// parseLevel reads a configuration's logLevel; anything unknown is info.
func parseLevel(s string) level {
	for l, n := range levelNames {
		if strings.EqualFold(strings.TrimSpace(s), n) {
			return level(l)
		}
	}
	return levelInfo
}

// timeFormat is the lines' @timestamp, microseconds and the zone.
const timeFormat = "2006-01-02T15:04:05.000000Z07:00"

// missingKey names the last value of an odd list of key-value pairs.
const missingKey = "EXTRA_VALUE_AT_END"

// jsonLogger writes one JSON object a line: @level, @message, @module
// (the plugin's name) and @timestamp, then the call's key-value pairs in
// their order. An error is its message; a value JSON cannot encode is
// written with %+v. It is the line hclog's JSON format wrote, which the
// plugin used before (docs/cni.md, "Starting the plugin"). Each line is
// one Write, so that plugins appending to one logFile do not interleave.
type jsonLogger struct {
	name  string
	level level
	now   func() time.Time
	mu    sync.Mutex
	w     io.Writer
	buf   []byte
}

func newJSONLogger(name string, l level, w io.Writer) *jsonLogger {
	return &jsonLogger{name: name, level: l, now: time.Now, w: w}
}

func (l *jsonLogger) Debug(msg string, kv ...any) { l.log(levelDebug, msg, kv) }
func (l *jsonLogger) Info(msg string, kv ...any)  { l.log(levelInfo, msg, kv) }
func (l *jsonLogger) Warn(msg string, kv ...any)  { l.log(levelWarn, msg, kv) }

func (l *jsonLogger) log(lv level, msg string, kv []any) {
	if lv < l.level {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b := append(l.buf[:0], `{"@level":"`...)
	b = append(b, levelNames[lv]...)
	b = append(b, `","@message":`...)
	b = appendJSON(b, msg)
	if l.name != "" {
		b = append(b, `,"@module":`...)
		b = appendJSON(b, l.name)
	}
	b = append(b, `,"@timestamp":"`...)
	b = l.now().AppendFormat(b, timeFormat)
	b = append(b, '"')
	if len(kv)%2 != 0 {
		kv = append(kv[:len(kv)-1:len(kv)-1], missingKey, kv[len(kv)-1])
	}
	for i := 0; i < len(kv); i += 2 {
		key, ok := kv[i].(string)
		if !ok {
			key = fmt.Sprint(kv[i])
		}
		b = append(b, ',')
		b = appendJSON(b, key)
		b = append(b, ':')
		b = appendJSON(b, logValue(kv[i+1]))
	}
	b = append(b, "}\n"...)
	l.buf = b
	_, _ = l.w.Write(b)
}

// logValue is what a value is written as: an error its message (unless
// it encodes itself), anything else as encoding/json has it.
func logValue(v any) any {
	if err, ok := v.(error); ok {
		switch v.(type) {
		case json.Marshaler, encoding.TextMarshaler:
		default:
			return err.Error()
		}
	}
	return v
}

// appendJSON appends v's JSON, or, when v has none (a channel, a
// function, a failing marshaler), its %+v as a JSON string.
func appendJSON(b []byte, v any) []byte {
	j, err := json.Marshal(v)
	if err != nil {
		j, _ = json.Marshal(fmt.Sprintf("%+v", v))
	}
	return append(b, j...)
}
