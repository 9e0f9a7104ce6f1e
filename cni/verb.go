package cni

import (
	"context"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/hashicorp/go-hclog"
)

// Names of the two plugins, as their loggers call them.
const (
	pluginName = "kvipam"
	ipamName   = "kvipam-ipam"
)

// verb is what every CNI verb of both plugins starts from: the parsed
// network configuration, the plugin's logger and the node agent.
type verb struct {
	c   *Config
	log hclog.Logger
	ag  Agent
	// done closes the logger's file.
	done func()
}

// begin is the prologue of a verb: it parses args' configuration with
// parse (ParseConfig and the like), opens the logger called name and
// dials the agent. A DEL's configuration may carry a key kvipam does not
// know (it tears down what an older kvipam set up): that is logged. The
// caller defers done.
func (o IO) begin(name string, parse func([]byte) (*Config, error), args *skel.CmdArgs) (*verb, error) {
	c, err := parse(args.StdinData)
	if err != nil {
		return nil, err
	}
	log, closeLog := newLogger(name, c, o.Stderr)
	if c.UnknownKey != nil {
		log.Warn("configuration has a key kvipam does not know; ADD refuses it", "error", c.UnknownKey)
	}
	return &verb{c: c, log: log, ag: o.agent(c), done: closeLog}, nil
}

// bounded is a context for one call to the agent, bounded by the
// configuration's agent timeout.
func (v *verb) bounded() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), v.c.AgentTimeout)
}
