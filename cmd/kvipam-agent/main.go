// Command kvipam-agent is kvipam's per-node daemon. See package agent and
// `kvipam-agent -h`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

func main() {
	os.Exit(run(os.Args[1:], os.Getenv))
}

func run(args []string, getenv func(string) string) int {
	if len(args) > 0 {
		switch args[0] {
		case "install-cni":
			return runInstall(args[1:], os.Stdout, os.Stderr)
		case "uninstall-cni":
			return runUninstall(args[1:], os.Stdout, os.Stderr)
		case "health":
			return runHealth(args[1:], os.Stdout, os.Stderr)
		case "version":
			return runVersion(args[1:], os.Stdout, os.Stderr)
		}
	}
	cfg, err := loadConfig(args, getenv)
	switch {
	case errors.Is(err, errShowVersion):
		printVersion(os.Stdout)
		return 0
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintln(os.Stderr, "usage: kvipam-agent [flags] | install-cni [flags] | uninstall-cni [flags] | health [--live] | version\n"+err.Error()[len(flag.ErrHelp.Error()):])
		return 0
	case err != nil:
		fmt.Fprintf(os.Stderr, "kvipam-agent: configuration: %v\n", err)
		return 2
	}
	log := hclog.New(&hclog.LoggerOptions{Name: "kvipam-agent", Level: hclog.LevelFromString(cfg.LogLevel), JSONFormat: getenv("KVIPAM_LOG_JSON") == "1", Output: os.Stderr})
	a, err := agent.New(cfg, agent.Options{Logger: log, Version: buildinfo.Read().Version})
	if err != nil {
		log.Error("invalid configuration", "error", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := a.Run(ctx, nil); err != nil {
		log.Error("agent failed", "error", err)
		return 1
	}
	return 0
}
