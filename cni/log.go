package cni

import (
	"io"
	"os"

	"github.com/hashicorp/go-hclog"
)

// newLogger returns a plugin's logger: silent unless the configuration
// sets logLevel, then to logFile when set, else to stderr (which runtimes
// capture). The returned func closes the file.
func newLogger(name string, c *Config, stderr io.Writer) (hclog.Logger, func()) {
	if c == nil || c.LogLevel == "" || c.LogLevel == "off" {
		return hclog.NewNullLogger(), func() {}
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
	return hclog.New(&hclog.LoggerOptions{Name: name, Level: hclog.LevelFromString(c.LogLevel), Output: out, JSONFormat: true}), closeFn
}
