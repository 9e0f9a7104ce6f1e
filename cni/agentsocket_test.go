package cni

import (
	"bytes"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

// TestMissingAgentSocketFailsFast: with no agent at the socket (no file,
// or a stale socket nobody listens on), ADD fails at once with code 11
// and a message naming the path, instead of waiting agentTimeout (a
// minute here) for an agent that is not coming. The test's own timer is
// only a safety net; the assertion is the error.
func TestMissingAgentSocketFailsFast(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.Listen("unix", stale)
	require.NoError(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, ln.Close()) // the file stays: connect is refused

	for name, sock := range map[string]string{"no socket file": filepath.Join(dir, "missing.sock"), "nobody listens": stale} {
		t.Run(name, func(t *testing.T) {
			p := &IPAM{IO{Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}}} // the real client
			conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","agentSocket":%q,"agentTimeout":"1m","delQueueDir":%q}}`, sock, t.TempDir())
			args := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", StdinData: []byte(conf)}
			done := make(chan error, 1)
			go func() { done <- p.Add(args) }()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("ADD still waits for the agent after 30s; agentTimeout is 1m")
			}
			require.Error(t, err)
			t.Log(err)
			require.Equal(t, uint(types.ErrTryAgainLater), Code(err), "code of %v", err)
			require.Contains(t, err.Error(), sock)
			require.NotContains(t, err.Error(), "not ready after", "it waited for the agent")
		})
	}
}
