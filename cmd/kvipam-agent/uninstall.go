package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/kvipam/kvipam/agent"
	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/routing"
)

// uninstall-cni undoes install-cni on a node: it removes the conflist
// first (from then on the runtime has no kvipam network: with no other
// conflist the node's runtime reports its network not ready, and kubelet
// marks the node NotReady rather than keeping it Ready while every pod's
// ADD fails), then kvipam's own plugins. The reference plugins install-cni
// also installs (loopback, portmap, bandwidth) stay: another network on
// the node may use them. Then, unless --cni-only, what the agent left in
// the node's network: its routes to other nodes' blocks, the VXLAN device,
// its egress masquerade table (nftables inet kvipam) and its eBPF pins
// (routing.Remove, agent.RemoveEgress, bpf.RemovePins). Running it
// again changes nothing. With --wait it
// then waits for SIGTERM, as the main container of the cleanup DaemonSet
// (deploy/kubernetes/uninstall), whose pods are Ready only once the
// removal is done.

type uninstallFlags struct {
	binDir, confDir, conflistName, plugins string
	netns, bpfPinDir                       string
	cniOnly, wait                          bool
}

func runUninstall(args []string, stdout, stderr io.Writer) int {
	var f uninstallFlags
	cmd := newSubcommand("uninstall-cni", stderr)
	fs := cmd.flags
	fs.StringVar(&f.binDir, "bin-dir", "/host/opt/cni/bin", "the host's CNI binary directory, as mounted")
	fs.StringVar(&f.confDir, "conf-dir", "/host/etc/cni/net.d", "the host's CNI configuration directory, as mounted")
	fs.StringVar(&f.conflistName, "conflist-name", "10-kvipam.conflist", "the file name of the conflist install-cni installed")
	fs.StringVar(&f.plugins, "plugins", "kvipam,kvipam-ipam", "plugins to remove, comma separated (kvipam's own; not the reference plugins another network may share)")
	fs.StringVar(&f.netns, "netns", "", "the network namespace whose kvipam routes, VXLAN device and masquerade table go (empty: this process's: the node's with hostNetwork)")
	fs.StringVar(&f.bpfPinDir, "bpf-pin-dir", bpf.DefaultPinDir, "the agent's bpffs pin directory, removed with its pins")
	fs.BoolVar(&f.cniOnly, "cni-only", false, "remove only the CNI configuration and plugins: leave routes, the VXLAN device, the masquerade table and the eBPF pins")
	fs.BoolVar(&f.wait, "wait", false, "after removing, wait for SIGTERM (a DaemonSet's container)")
	if code, done := cmd.parse(args); done {
		return code
	}
	if err := uninstall(f, stdout); err != nil {
		return cmd.fail("%v", err)
	}
	if f.wait {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		fmt.Fprintln(stdout, "removed; waiting for SIGTERM")
		<-ctx.Done()
	}
	return 0
}

func uninstall(f uninstallFlags, out io.Writer) error {
	if f.conflistName == "" || strings.ContainsRune(f.conflistName, '/') {
		return fmt.Errorf("conflist name %q: a file name, not a path", f.conflistName)
	}
	if err := removeFile(f.confDir, f.conflistName, out); err != nil {
		return err
	}
	for _, p := range splitList(f.plugins) {
		if strings.ContainsRune(p, '/') {
			return fmt.Errorf("plugin %q: a name, not a path", p)
		}
		if err := removeFile(f.binDir, p, out); err != nil {
			return err
		}
	}
	if f.cniOnly {
		return nil
	}
	removed, err := routing.Remove(f.netns)
	for _, r := range removed {
		fmt.Fprintf(out, "%s: removed\n", r)
	}
	if err != nil {
		return fmt.Errorf("remove routing: %w", err)
	}
	gone, err := agent.RemoveEgress(f.netns)
	if err != nil {
		return fmt.Errorf("remove egress masquerade: %w", err)
	}
	if gone {
		fmt.Fprintln(out, "egress masquerade table (nftables inet kvipam): removed")
	}
	removed, err = bpf.RemovePins(f.bpfPinDir)
	for _, r := range removed {
		fmt.Fprintf(out, "%s: unpinned\n", r)
	}
	if err != nil {
		return fmt.Errorf("remove eBPF pins: %w", err)
	}
	return nil
}

// removeFile removes dir/name, if it is there, and syncs dir, so the
// removal survives a crash of the node.
func removeFile(dir, name string, out io.Writer) error {
	p := filepath.Join(dir, name)
	err := os.Remove(p)
	if errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(out, "%s: absent\n", p)
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove %s: %w", p, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	fmt.Fprintf(out, "%s: removed\n", p)
	return nil
}
