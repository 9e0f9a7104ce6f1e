package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvipam/kvipam/internal/foundation/atomicfile"
)

// install-cni puts the CNI plugins and the conflist where the container
// runtime reads them, as the DaemonSet's init container does (no shell in
// the image). Each file is written to a temporary name in its target
// directory, synced, and renamed over the target, so a runtime never runs
// a half-copied plugin or reads a half-written conflist. A target that is
// already the same is left alone, so running it again changes nothing.

type installFlags struct {
	from, binDir, confDir, conflist string
	plugins                         string
}

func runInstall(args []string, stdout, stderr io.Writer) int {
	var f installFlags
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.from, "from", "/usr/local/bin", "directory holding the plugin binaries")
	fs.StringVar(&f.plugins, "plugins", "kvipam,kvipam-ipam,loopback", "plugins to install, comma separated")
	fs.StringVar(&f.binDir, "bin-dir", "/host/opt/cni/bin", "the host's CNI binary directory, as mounted")
	fs.StringVar(&f.confDir, "conf-dir", "/host/etc/cni/net.d", "the host's CNI configuration directory, as mounted")
	fs.StringVar(&f.conflist, "conflist", "/etc/kvipam/10-kvipam.conflist", "the conflist to install (its file name is kept); empty installs none")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvipam-agent install-cni: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if err := install(f, stdout); err != nil {
		fmt.Fprintf(stderr, "kvipam-agent install-cni: %v\n", err)
		return 1
	}
	return 0
}

func install(f installFlags, out io.Writer) error {
	for _, p := range strings.Split(f.plugins, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if strings.ContainsRune(p, '/') {
			return fmt.Errorf("plugin %q: a name, not a path", p)
		}
		if err := installFile(filepath.Join(f.from, p), f.binDir, p, 0o755, out); err != nil {
			return err
		}
	}
	if f.conflist != "" {
		if err := installFile(f.conflist, f.confDir, filepath.Base(f.conflist), 0o644, out); err != nil {
			return err
		}
	}
	return nil
}

// installFile writes src's content to dir/name atomically, unless it is
// already there.
func installFile(src, dir, name string, perm os.FileMode, out io.Writer) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("read %s: %w", src, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("make %s: %w", dir, err)
	}
	dst := filepath.Join(dir, name)
	if cur, err := os.ReadFile(dst); err == nil && bytes.Equal(cur, data) {
		if st, err := os.Stat(dst); err == nil && st.Mode().Perm() == perm {
			fmt.Fprintf(out, "%s: up to date\n", dst)
			return nil
		}
	}
	if err := atomicfile.Write(dir, name, data, perm); err != nil {
		return err
	}
	fmt.Fprintf(out, "%s: installed (%d bytes)\n", dst, len(data))
	return nil
}
