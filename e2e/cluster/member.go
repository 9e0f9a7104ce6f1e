package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
)

// member is one etcd member: a fixed name, ports, data dir and log file,
// and the process currently running it, if any. Its methods are safe for
// concurrent use.
type member struct {
	name               string
	bin                string
	args               []string
	clientURL, peerURL string
	httpURL            string // the HTTP endpoints' own URL; empty when they share clientURL
	dataDir, logPath   string
	certs              ClientFiles // the member's own certificate
	statusTLS          *tls.Config // how the harness asks it for its status

	mu     sync.Mutex
	proc   *process         // nil when killed
	status *grpc.ClientConn // to this member only; nil when killed
}

// process is one run of a member.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has been reaped
	err  error         // how it ended; read after done
}

// exited reports whether the process has ended (by itself, unless killed).
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// start runs the member's process, logging to its log file, and opens the
// status connection. The caller holds no lock.
func (m *member) start(l *launcher) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc != nil {
		return fmt.Errorf("start %s: already running", m.name)
	}
	f, err := os.OpenFile(m.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open log: %w", err)
	}
	defer f.Close() // the process has its own copy
	fmt.Fprintf(f, "=== kvipam cluster: start %s at %s\n", m.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(m.bin, m.args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = sysProcAttr()
	if err := l.start(cmd); err != nil {
		return fmt.Errorf("exec etcd: %w", err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() { // owned by p: ends when the process does, which kill ensures
		p.err = cmd.Wait()
		close(p.done)
	}()
	m.proc = p
	conn, err := dialStatus(m.clientURL, m.statusTLS)
	if err != nil {
		m.killLocked()
		return err
	}
	m.status = conn
	return nil
}

// waitPeerServing waits until the member serves its peer URL: it has
// bootstrapped (it need not have a leader yet).
func (m *member) waitPeerServing(ctx context.Context) error {
	cert, err := tls.LoadX509KeyPair(m.certs.CertFile, m.certs.KeyFile)
	if err != nil {
		return fmt.Errorf("load member certificate: %w", err)
	}
	tc := m.statusTLS.Clone()
	tc.Certificates = []tls.Certificate{cert}
	tr := &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 200 * time.Millisecond}
	err = poll(ctx, func() error {
		if _, err := m.statusConn(); err != nil {
			return err // it exited
		}
		resp, err := hc.Get(m.peerURL + "/version")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s/version: %s", m.peerURL, resp.Status)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("wait for %s to serve peers: %w", m.name, err)
	}
	return nil
}

// kill sends SIGKILL (which also ends a stopped process), waits until the
// process is reaped and closes the status connection. It returns
// ErrNotRunning if there is no process, and ErrExited if it had already
// ended by itself.
func (m *member) kill() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil {
		return fmt.Errorf("kill %s: %w", m.name, ErrNotRunning)
	}
	return m.killLocked()
}

// killLocked is kill with m.mu held.
func (m *member) killLocked() error {
	p := m.proc
	var err error
	if p.exited() {
		err = fmt.Errorf("%s: %w: %v", m.name, ErrExited, p.err)
	} else if serr := p.cmd.Process.Signal(syscall.SIGKILL); serr != nil && !errors.Is(serr, os.ErrProcessDone) {
		err = fmt.Errorf("kill %s: %w", m.name, serr)
	}
	<-p.done
	m.proc = nil
	if m.status != nil {
		_ = m.status.Close()
		m.status = nil
	}
	return err
}

// signal sends sig to the running process and waits until the kernel shows
// it stopped (SIGSTOP) or running again (SIGCONT).
func (m *member) signal(sig syscall.Signal) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil {
		return fmt.Errorf("signal %s: %w", m.name, ErrNotRunning)
	}
	if m.proc.exited() {
		return fmt.Errorf("signal %s: %w: %v", m.name, ErrExited, m.proc.err)
	}
	if err := m.proc.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s: %w", m.name, err)
	}
	if err := waitStopped(m.proc.cmd.Process.Pid, sig == syscall.SIGSTOP, m.proc.done); err != nil {
		return fmt.Errorf("signal %s: %w", m.name, err)
	}
	return nil
}

// running reports whether the member has a live process.
func (m *member) running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.proc != nil && !m.proc.exited()
}

// statusConn is the connection to ask the member for its status, or
// ErrNotRunning (ErrExited) when it has no live process.
func (m *member) statusConn() (*grpc.ClientConn, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil {
		return nil, fmt.Errorf("%s: %w", m.name, ErrNotRunning)
	}
	if m.proc.exited() {
		return nil, fmt.Errorf("%s: %w: %v (log %s)", m.name, ErrExited, m.proc.err, m.logPath)
	}
	return m.status, nil
}

// Kill sends SIGKILL to member i and waits until its process is reaped.
func (c *Cluster) Kill(i int) error {
	m, err := c.member(i)
	if err != nil {
		return err
	}
	return m.kill()
}

// Stop freezes member i with SIGSTOP: its sockets stay open, it answers
// nothing. It returns once the kernel shows the process stopped.
func (c *Cluster) Stop(i int) error {
	m, err := c.member(i)
	if err != nil {
		return err
	}
	return m.signal(syscall.SIGSTOP)
}

// Cont resumes member i, stopped by Stop, with SIGCONT.
func (c *Cluster) Cont(i int) error {
	m, err := c.member(i)
	if err != nil {
		return err
	}
	return m.signal(syscall.SIGCONT)
}

// Restart starts member i again on its data dir and ports, killing it
// first if it is running. It does not wait for the member to catch up:
// use WaitRevision or WaitHealthy. If the member's process had ended by
// itself, Restart returns that (ErrExited) and starts nothing; a second
// call starts it.
func (c *Cluster) Restart(i int) error {
	m, err := c.member(i)
	if err != nil {
		return err
	}
	if err := m.kill(); err != nil && !errors.Is(err, ErrNotRunning) {
		return err
	}
	return m.start(c.launcher)
}

// Running reports whether member i has a live process (a stopped one
// counts as live).
func (c *Cluster) Running(i int) bool {
	m, err := c.member(i)
	return err == nil && m.running()
}

// cpu is the CPU time the member's running process has used; 0 when it
// is killed.
func (m *member) cpu() (time.Duration, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil || m.proc.exited() {
		return 0, nil
	}
	return processCPU(m.proc.cmd.Process.Pid)
}

// rss is the member process's resident memory in bytes; 0 if it is not
// running.
func (m *member) rss() (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil || m.proc.exited() {
		return 0, nil
	}
	return processRSS(m.proc.cmd.Process.Pid)
}
