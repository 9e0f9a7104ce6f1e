package agent

import (
	"errors"

	"github.com/hashicorp/go-hclog"
)

// newBPFDatapath opens the eBPF datapath. The eBPF programs are not part
// of this build yet, so auto mode falls back to routes.
func newBPFDatapath(pinDir, netnsPath string, log hclog.Logger) (Datapath, error) {
	return nil, errors.New("eBPF datapath not in this build")
}
