// Package atomicfile writes small state files so that a reader (or a
// process restarted after a crash) sees either the old content or the
// whole new content, and (Write, not Replace) a write that returned
// survives a power loss.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// TmpPrefix starts the names of temporary files Write leaves behind if it
// is killed mid-write; listings of the directory should skip them.
const TmpPrefix = ".tmp-"

// Write writes data to dir/name: a temporary file in dir, synced, renamed
// over name, then the directory synced.
func Write(dir, name string, data []byte, perm os.FileMode) error {
	if err := replace(dir, name, data, perm, true); err != nil {
		return err
	}
	return SyncDir(dir)
}

// Replace writes data to dir/name as Write does, but syncs nothing: a
// reader, or a process restarted after a crash, sees the old content or
// the whole new one, while after a power loss the file may hold either,
// or be empty or gone. It is for state that does not outlive the boot
// (a pod's veth and eBPF attachment end with it), at a fraction of the
// cost: no waits for the journal.
func Replace(dir, name string, data []byte, perm os.FileMode) error {
	return replace(dir, name, data, perm, false)
}

func replace(dir, name string, data []byte, perm os.FileMode, sync bool) error {
	f, err := os.CreateTemp(dir, TmpPrefix+"*")
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	tmp := f.Name()
	_, werr := f.Write(data)
	if werr == nil {
		werr = f.Chmod(perm)
	}
	if werr == nil && sync {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(tmp, filepath.Join(dir, name))
	}
	if werr != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s in %s: %w", name, dir, werr)
	}
	return nil
}

// SyncDir makes renames and removals in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
