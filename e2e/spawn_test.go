package e2e

import (
	"os/exec"
	"runtime"
	"sync"

	"github.com/containernetworking/plugins/pkg/ns"
)

// Long-lived children (agents) start from one OS thread that lives as long
// as the test process. Their Pdeathsig is tied to the thread that started
// them, and a thread that ran a locked goroutine (ns.Do, testutils.NewNS)
// can be killed by the Go runtime at any time: an agent started from such
// a thread would be killed with it. From this thread, an agent dies only
// when the test process does, even when a timeout skips the cleanups.
var (
	spawnOnce sync.Once
	spawnReqs chan spawnReq
)

type spawnReq struct {
	in   ns.NetNS
	cmd  *exec.Cmd
	done chan error
}

// startIn starts cmd with the thread in netns in, from the spawner thread;
// a nil in is the test process's own namespace.
func startIn(in ns.NetNS, cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnReqs = make(chan spawnReq)
		go func() {
			runtime.LockOSThread() // never unlocked: the thread lives on
			orig, err := ns.GetCurrentNS()
			for r := range spawnReqs {
				if err != nil {
					r.done <- err
					continue
				}
				if r.in == nil {
					r.done <- r.cmd.Start()
					continue
				}
				if err := r.in.Set(); err != nil {
					r.done <- err
					continue
				}
				serr := r.cmd.Start()
				if err := orig.Set(); err != nil {
					panic("spawner thread cannot return to its netns: " + err.Error())
				}
				r.done <- serr
			}
		}()
	})
	r := spawnReq{in: in, cmd: cmd, done: make(chan error)}
	spawnReqs <- r
	return <-r.done
}
