package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/internal/foundation/atomicfile"
)

// install-cni puts the CNI plugins and the conflist where the container
// runtime reads them, as the DaemonSet's init container does (no shell in
// the image). Each file is written to a temporary name in its target
// directory, synced, and renamed over the target, so a runtime never runs
// a half-copied plugin or reads a half-written conflist. A target that is
// already the same is left alone, so running it again changes nothing.
//
// Every plugin the conflist chains (each "type", and each "ipam" type) is
// installed besides --plugins, and one missing from --from fails the
// install: a node must never get a conflist naming a plugin it does not
// have, on which every pod's ADD would fail.

type installFlags struct {
	from, binDir, confDir, conflist string
	plugins                         string
}

func runInstall(args []string, stdout, stderr io.Writer) int {
	var f installFlags
	cmd := newSubcommand("install-cni", stderr)
	fs := cmd.flags
	fs.StringVar(&f.from, "from", "/usr/local/bin", "directory holding the plugin binaries")
	fs.StringVar(&f.plugins, "plugins", "kvipam,kvipam-ipam,loopback", "plugins to install, comma separated")
	fs.StringVar(&f.binDir, "bin-dir", "/host/opt/cni/bin", "the host's CNI binary directory, as mounted")
	fs.StringVar(&f.confDir, "conf-dir", "/host/etc/cni/net.d", "the host's CNI configuration directory, as mounted")
	fs.StringVar(&f.conflist, "conflist", "/etc/kvipam/10-kvipam.conflist", "the conflist to install (its file name is kept); empty installs none")
	if code, done := cmd.parse(args); done {
		return code
	}
	if err := install(f, stdout); err != nil {
		return cmd.fail("%v", err)
	}
	return 0
}

func install(f installFlags, out io.Writer) error {
	plugins := splitList(f.plugins)
	if f.conflist != "" {
		chained, err := conflistPlugins(f.conflist)
		if err != nil {
			return err
		}
		for _, p := range chained {
			if _, err := os.Stat(filepath.Join(f.from, p)); err != nil {
				return fmt.Errorf("the conflist %s chains the plugin %q, which is not in %s: %w", f.conflist, p, f.from, err)
			}
			if !slices.Contains(plugins, p) {
				plugins = append(plugins, p)
			}
		}
	}
	for _, p := range plugins {
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

// conflistPlugins are the plugin types the conflist at path runs: each
// plugin's type and its IPAM plugin's, in order, once each.
func conflistPlugins(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	var list struct {
		Plugins []struct {
			Type string `json:"type"`
			IPAM struct {
				Type string `json:"type"`
			} `json:"ipam"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(data, &list); err != nil {
		return nil, fmt.Errorf("conflist %s: %w", path, err)
	}
	var types []string
	for i, p := range list.Plugins {
		if p.Type == "" {
			return nil, fmt.Errorf("conflist %s: plugin %d has no type", path, i)
		}
		for _, t := range []string{p.Type, p.IPAM.Type} {
			if t != "" && !slices.Contains(types, t) {
				types = append(types, t)
			}
		}
	}
	return types, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
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
