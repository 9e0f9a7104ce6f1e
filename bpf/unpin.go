package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// RemovePins removes, for an uninstall, what the agent pinned under
// pinDir: the TCX link of each host veth and of the host port programs
// (unpinned, a link nobody else holds detaches) and the maps (freed once no program uses them), then
// the directory. Only the names the agent pins are removed; a directory
// that holds anything else is left, with an error naming it. A missing
// pinDir is nothing to do. It returns the paths it removed.
//
// Programs attached as clsact filters (attach mode tc) stay on the host
// veths of running pods, with the maps they use, until those veths go.
func RemovePins(pinDir string) ([]string, error) {
	if _, err := os.Stat(pinDir); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err := checkBPFFS(pinDir); err != nil {
		return nil, err
	}
	var removed []string
	remove := func(p string) error {
		err := os.Remove(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil
		case err != nil:
			return fmt.Errorf("unpin: %w", err)
		}
		removed = append(removed, p)
		return nil
	}
	// The host veths' links, then the host port programs' (uplinks, lo).
	for _, dir := range []string{linksDir, hostLinksDir} {
		links := filepath.Join(pinDir, dir)
		entries, err := os.ReadDir(links)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return removed, fmt.Errorf("unpin: %w", err)
		}
		for _, e := range entries {
			if err := remove(filepath.Join(links, e.Name())); err != nil {
				return removed, err
			}
		}
		if err := remove(links); err != nil {
			return removed, err
		}
	}
	spec, err := loadKvipam()
	if err != nil {
		return removed, fmt.Errorf("unpin: load the program's spec: %w", err)
	}
	for name, m := range spec.Maps {
		if m.Pinning != ebpf.PinByName {
			continue
		}
		if err := remove(filepath.Join(pinDir, name)); err != nil {
			return removed, err
		}
	}
	if err := remove(pinDir); err != nil {
		return removed, fmt.Errorf("%w (left: not all of it is the agent's)", err)
	}
	return removed, nil
}
