package bpf

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestRemovePinsDetaches: an uninstall's RemovePins, with no agent
// running, unpins the maps and the link of an attached endpoint, which
// detaches it (the host veth runs no kvipam program after), and removes
// the pin directory; run again, nothing is left to do. A directory that
// holds a pin of someone else is left, with an error.
func TestRemovePinsDetaches(t *testing.T) {
	requireDatapath(t)
	h := newHost(t)
	p := h.addPod(t, 1)
	dir := pinDir(t)
	d := openDatapath(t, dir)
	h.attach(t, d, p.ep)
	require.NotEmpty(t, h.tcx(t, p.ep.HostIfIndex).links)
	inNS(t, h.ns, func() error { return d.AttachHostPorts(nil) }) // lo's program
	require.NoError(t, d.Close())

	removed, err := RemovePins(dir)
	require.NoError(t, err)
	require.Contains(t, removed, filepath.Join(dir, "kvipam_addrs"))
	require.Contains(t, removed, filepath.Join(dir, "hostlinks", "lo"))
	require.Contains(t, removed, dir)
	require.NoDirExists(t, dir)
	// The kernel frees a link whose last reference went in deferred
	// work: await the detach, as it happens.
	require.Eventually(t, func() bool { return len(h.tcx(t, p.ep.HostIfIndex).links) == 0 }, time.Minute, 5*time.Millisecond, "unpinned, the link detached")

	removed, err = RemovePins(dir)
	require.NoError(t, err)
	require.Empty(t, removed)

	other := pinDir(t)
	require.NoError(t, os.MkdirAll(filepath.Join(other, "theirs"), 0o700))
	_, err = RemovePins(other)
	require.ErrorContains(t, err, "not all of it is the agent's")
	require.DirExists(t, filepath.Join(other, "theirs"))
}
