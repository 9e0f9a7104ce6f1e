package cni

import (
	"io"
	"os"
)

// logger is what the plugins log through: a message and key-value
// pairs, at three levels. newLogger's is JSON lines (jsonLogger).
type logger interface {
	Debug(msg string, kv ...any)
	Info(msg string, kv ...any)
	Warn(msg string, kv ...any)
}

// newLogger returns a plugin's logger: silent unless the configuration
// sets logLevel, then to logFile when set, else to stderr (which runtimes
// capture). The returned func closes the file.
func newLogger(name string, c *Config, stderr io.Writer) (logger, func()) {
	if c == nil || c.LogLevel == "" || c.LogLevel == "off" {
		return &jsonLogger{level: levelOff}, func() {}
	}
	out, closeFn := stderr, func() {}
	if c.LogFile != "" {
		f, err := os.OpenFile(c.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err == nil {
			out, closeFn = f, func() { _ = f.Close() }
		}
	}
	if out == nil {
		out = io.Discard
	}
	return newJSONLogger(name, parseLevel(c.LogLevel), out), closeFn
}
