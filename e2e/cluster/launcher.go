package cluster

import (
	"errors"
	"os/exec"
	"runtime"
	"sync"
)

// launcher starts processes from one OS thread that stays locked to its
// goroutine until the cluster is cleaned up. Pdeathsig fires when the
// thread that forked the child ends, not the process, and Go ends a thread
// whenever a goroutine exits while locked to it (network namespace code
// does that on purpose): a member forked from an arbitrary thread could be
// killed in the middle of a test. Members therefore also run in the
// launcher thread's network namespace, the test process's, whatever
// namespace the caller of Start or Restart is in.
type launcher struct {
	mu     sync.Mutex
	closed bool
	reqs   chan launch // closed by close
	done   chan struct{}
}

// launch asks the launcher to start cmd and send the outcome to errc.
type launch struct {
	cmd  *exec.Cmd
	errc chan error
}

// newLauncher starts the launcher's goroutine; close stops it.
func newLauncher() *launcher {
	l := &launcher{reqs: make(chan launch), done: make(chan struct{})}
	go l.run()
	return l
}

func (l *launcher) run() {
	defer close(l.done)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for r := range l.reqs {
		r.errc <- r.cmd.Start()
	}
}

// start starts cmd from the launcher's thread.
func (l *launcher) start(cmd *exec.Cmd) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return errors.New("cluster already cleaned up")
	}
	errc := make(chan error, 1)
	l.reqs <- launch{cmd: cmd, errc: errc}
	return <-errc
}

// close stops the launcher. Call it only once every process it started
// has ended: unlocking lets Go reuse or end the thread.
func (l *launcher) close() {
	l.mu.Lock()
	if !l.closed {
		l.closed = true
		close(l.reqs)
	}
	l.mu.Unlock()
	<-l.done
}
