package cni

import (
	"context"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/kvipam/kvipam/agent/api"
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
	log logger
	ag  Agent
	// ctx bounds a verb's calls to the agent together by the
	// configuration's agent timeout, from begin: STATUS and GC of both
	// plugins, kvipam-ipam's CHECK. ADD bounds each call instead, DEL its
	// release (releaseOrQueue), and kvipam's CHECK the calls after its
	// local checks.
	ctx context.Context
	// done cancels ctx and closes the logger's file.
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
	ctx, cancel := context.WithTimeout(context.Background(), c.AgentTimeout)
	return &verb{c: c, log: log, ag: o.agent(c), ctx: ctx, done: func() { cancel(); closeLog() }}, nil
}

// beginAdd is begin for ADD, which also reads the attachment's owner,
// with the pod's names from CNI_ARGS. The caller defers done.
func (o IO) beginAdd(name string, parse func([]byte) (*Config, error), args *skel.CmdArgs) (*verb, api.Owner, error) {
	v, err := o.begin(name, parse, args)
	if err != nil {
		return nil, api.Owner{}, err
	}
	own, err := owner(args, v.c.Name)
	if err != nil {
		v.done()
		return nil, api.Owner{}, err
	}
	return v, own, nil
}
