package main

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestInstallCNI: install-cni copies the plugins and the conflist into the
// host directories by rename (a new inode: a runtime never sees a file
// half written), leaves no temporary file, and a second run changes
// nothing; a changed plugin is replaced.
func TestInstallCNI(t *testing.T) {
	from, bin, conf := t.TempDir(), t.TempDir(), t.TempDir()
	for _, p := range []string{"kvipam", "kvipam-ipam", "loopback"} {
		require.NoError(t, os.WriteFile(filepath.Join(from, p), []byte("#!binary "+p), 0o700))
	}
	conflist := filepath.Join(t.TempDir(), "10-kvipam.conflist")
	require.NoError(t, os.WriteFile(conflist, []byte(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam"}]}`), 0o600))
	args := []string{"--from", from, "--bin-dir", bin, "--conf-dir", conf, "--conflist", conflist}
	run := func() string {
		var out, errs bytes.Buffer
		require.Equal(t, 0, runInstall(args, &out, &errs), errs.String())
		return out.String()
	}
	inode := func(path string) uint64 {
		st, err := os.Stat(path)
		require.NoError(t, err)
		return st.Sys().(*syscall.Stat_t).Ino
	}

	out := run()
	require.Equal(t, 4, strings.Count(out, "installed"), out)
	for _, p := range []string{"kvipam", "kvipam-ipam", "loopback"} {
		st, err := os.Stat(filepath.Join(bin, p))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o755), st.Mode().Perm(), "plugins are executable")
	}
	got, err := os.ReadFile(filepath.Join(conf, "10-kvipam.conflist"))
	require.NoError(t, err)
	require.Contains(t, string(got), `"name":"kvipam"`)
	before := inode(filepath.Join(bin, "kvipam"))

	out = run()
	require.Equal(t, 4, strings.Count(out, "up to date"), "idempotent: %s", out)
	require.Equal(t, before, inode(filepath.Join(bin, "kvipam")), "an unchanged plugin is not rewritten")

	require.NoError(t, os.WriteFile(filepath.Join(from, "kvipam"), []byte("#!binary kvipam v2"), 0o700))
	out = run()
	require.Contains(t, out, filepath.Join(bin, "kvipam")+": installed")
	require.NotEqual(t, before, inode(filepath.Join(bin, "kvipam")), "replaced by a rename, not written in place")
	for _, dir := range []string{bin, conf} {
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		for _, e := range entries {
			require.False(t, strings.HasPrefix(e.Name(), ".tmp-"), "no temporary file left: %s", e.Name())
		}
	}

	var errs bytes.Buffer
	require.Equal(t, 1, runInstall([]string{"--from", t.TempDir(), "--bin-dir", bin, "--conflist", ""}, &bytes.Buffer{}, &errs))
	require.Contains(t, errs.String(), "kvipam", "a missing plugin is named")
}

// TestInstallCNIChainedPlugins: install-cni installs every plugin the
// conflist chains (its types and IPAM types) besides --plugins, and fails,
// installing no conflist, when one is not in --from: a node must never get
// a conflist naming a plugin it does not have.
func TestInstallCNIChainedPlugins(t *testing.T) {
	from, bin, conf := t.TempDir(), t.TempDir(), t.TempDir()
	for _, p := range []string{"kvipam", "kvipam-ipam", "loopback", "portmap", "bandwidth"} {
		require.NoError(t, os.WriteFile(filepath.Join(from, p), []byte("#!binary "+p), 0o755))
	}
	conflist := filepath.Join(t.TempDir(), "10-kvipam.conflist")
	require.NoError(t, os.WriteFile(conflist, []byte(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[
		{"type":"kvipam"},{"type":"portmap","capabilities":{"portMappings":true}},{"type":"bandwidth"}]}`), 0o600))
	var out, errs bytes.Buffer
	require.Equal(t, 0, runInstall([]string{"--from", from, "--bin-dir", bin, "--conf-dir", conf, "--conflist", conflist}, &out, &errs), errs.String())
	for _, p := range []string{"kvipam", "kvipam-ipam", "loopback", "portmap", "bandwidth"} {
		require.FileExists(t, filepath.Join(bin, p), "installed: %s", out.String())
	}

	bin2, conf2 := t.TempDir(), t.TempDir()
	tuning := filepath.Join(t.TempDir(), "10-kvipam.conflist")
	require.NoError(t, os.WriteFile(tuning, []byte(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[
		{"type":"bridge","ipam":{"type":"kvipam-ipam"}},{"type":"tuning"}]}`), 0o600))
	errs.Reset()
	require.Equal(t, 1, runInstall([]string{"--from", from, "--bin-dir", bin2, "--conf-dir", conf2, "--conflist", tuning}, &bytes.Buffer{}, &errs))
	require.Contains(t, errs.String(), `chains the plugin "bridge"`)
	require.NoFileExists(t, filepath.Join(conf2, "10-kvipam.conflist"), "no conflist naming a missing plugin")
}

// TestUninstallCNI: uninstall-cni removes the conflist install-cni
// installed and kvipam's own plugins, keeps the reference plugins another
// network may share and any other conflist, and a second run changes
// nothing.
func TestUninstallCNI(t *testing.T) {
	from, bin, conf := t.TempDir(), t.TempDir(), t.TempDir()
	for _, p := range []string{"kvipam", "kvipam-ipam", "loopback", "portmap"} {
		require.NoError(t, os.WriteFile(filepath.Join(from, p), []byte("#!binary "+p), 0o755))
	}
	conflist := filepath.Join(t.TempDir(), "10-kvipam.conflist")
	require.NoError(t, os.WriteFile(conflist, []byte(`{"cniVersion":"1.0.0","name":"kvipam","plugins":[{"type":"kvipam"},{"type":"portmap"}]}`), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(conf, "20-other.conflist"), []byte(`{}`), 0o644))
	var out, errs bytes.Buffer
	require.Equal(t, 0, runInstall([]string{"--from", from, "--bin-dir", bin, "--conf-dir", conf, "--conflist", conflist}, &out, &errs), errs.String())
	require.FileExists(t, filepath.Join(conf, "10-kvipam.conflist"))

	args := append([]string{"--bin-dir", bin, "--conf-dir", conf}, scratchNodeState(t)...)
	out.Reset()
	require.Equal(t, 0, runUninstall(args, &out, &errs), errs.String())
	require.Equal(t, 3, strings.Count(out.String(), "removed"), out.String())
	require.NoFileExists(t, filepath.Join(conf, "10-kvipam.conflist"))
	require.NoFileExists(t, filepath.Join(bin, "kvipam"))
	require.NoFileExists(t, filepath.Join(bin, "kvipam-ipam"))
	require.FileExists(t, filepath.Join(bin, "loopback"), "the reference plugins stay")
	require.FileExists(t, filepath.Join(bin, "portmap"))
	require.FileExists(t, filepath.Join(conf, "20-other.conflist"), "another network's conflist stays")

	out.Reset()
	require.Equal(t, 0, runUninstall(args, &out, &errs), errs.String())
	require.Equal(t, 3, strings.Count(out.String(), "absent"), "idempotent: %s", out.String())
	require.Equal(t, 1, runUninstall([]string{"--conflist-name", "../x"}, &out, &errs), "a name, not a path")
}

// scratchNodeState points an uninstall's removal of routes, the VXLAN
// device and eBPF pins at a scratch network namespace and a pin directory
// that does not exist, never at the host's; without root (no namespace)
// it leaves them out.
func scratchNodeState(t *testing.T) []string {
	t.Helper()
	if os.Geteuid() != 0 {
		return []string{"--cni-only"}
	}
	return []string{"--netns", nstest.NewNS(t).Path(), "--bpf-pin-dir", filepath.Join(t.TempDir(), "pins")}
}

// TestHealth: the probe subcommand exits 0 for a ready agent and 1, with
// the reason, when nothing answers on the socket.
func TestHealth(t *testing.T) {
	var out, errs bytes.Buffer
	missing := filepath.Join(t.TempDir(), "none.sock")
	require.Equal(t, 1, runHealth([]string{"--socket", missing, "--timeout", "500ms"}, &out, &errs))
	require.Contains(t, errs.String(), "not answering")

	e := etcdtest.Start(t)
	sockDir, err := os.MkdirTemp("", "kvipam-sock-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	cfg := agent.DefaultConfig()
	cfg.Node, cfg.StateDir, cfg.Socket, cfg.Etcd = "node-h", t.TempDir(), filepath.Join(sockDir, "agent.sock"), agent.EtcdConfig{Endpoints: e.Endpoints()}
	cfg.Pools = []allocator.Pool{{Name: "default", BlockSizeV4: 28, CIDRs: mustPrefixes("10.92.0.0/24")}}
	cfg.MetricsAddr, cfg.Datapath, cfg.MTU, cfg.Routing = "", agent.DatapathRoutes, 1500, agent.RoutingNone
	cfg.NetNS = nstest.NewNS(t).Path()
	a, err := agent.New(cfg, agent.Options{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- a.Run(ctx, ready) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("agent: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("agent not ready")
	}
	out.Reset()
	require.Equal(t, 0, runHealth([]string{"--socket", cfg.Socket}, &out, &errs), errs.String())
	require.Contains(t, out.String(), "node node-h: ready=true")
	require.Equal(t, 0, runHealth([]string{"--socket", cfg.Socket, "--live"}, &out, &errs))
}

func mustPrefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}
