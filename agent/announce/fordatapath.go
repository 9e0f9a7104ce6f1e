package announce

import (
	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/bpf"
)

// ForDatapath returns the watcher that fits the agent's datapath: with the
// eBPF datapath (dp not nil) a BPFWatcher, which needs no socket per veth;
// with the routes datapath (dp nil) a PacketWatcher whose sockets are
// created in netnsPath, the host veths' namespace ("" the caller's).
func ForDatapath(dp *bpf.Datapath, netnsPath string, log hclog.Logger) (Watcher, error) {
	if dp != nil {
		return NewBPFWatcher(dp, log)
	}
	return NewPacketWatcher(netnsPath, log)
}
