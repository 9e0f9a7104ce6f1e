// Package hostlocal reads host-local's state on one node: the directory
// /var/lib/cni/networks/<network>, one file per address (named by the
// address, holding the container ID and the interface name), as
// github.com/containernetworking/plugins' host-local disk backend writes
// it. It only reads: the files stay as they are until kvipamctl import
// finalize.
package hostlocal

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/records"
)

// Files host-local keeps beside the addresses: its lock, and the last
// address handed out of each range.
const (
	lockFile       = "lock"
	lastReservedIP = "last_reserved_ip."
)

// Read reads dir, host-local's directory of one network on node, under a
// shared lock of host-local's own lock file (if there is one), so no
// address is read half written. Each address file becomes an Allocation
// of node owned by its container ID and interface. A file it cannot read as host-local's is an error.
func Read(dir, node string) ([]adopt.Allocation, error) {
	if node == "" {
		return nil, fmt.Errorf("%w: host-local: no node name", records.ErrBadRequest)
	}
	if lf, err := os.Open(filepath.Join(dir, lockFile)); err == nil {
		defer lf.Close()
		if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_SH); err != nil {
			return nil, fmt.Errorf("host-local %s: lock: %w", dir, err)
		}
		defer syscall.Flock(int(lf.Fd()), syscall.LOCK_UN) //nolint:errcheck // closed next
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("host-local %s: %w", dir, err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("host-local: read %s: %w", dir, err)
	}
	var out []adopt.Allocation
	for _, e := range ents {
		name := e.Name()
		if name == lockFile || strings.HasPrefix(name, lastReservedIP) {
			continue
		}
		addr, err := netip.ParseAddr(name)
		if err != nil || e.IsDir() {
			return nil, fmt.Errorf("%w: host-local %s: %q is not an address file of host-local", records.ErrBadRequest, dir, name)
		}
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, fmt.Errorf("host-local: %w", err)
		}
		o, err := ParseOwner(string(b))
		if err != nil {
			return nil, fmt.Errorf("%w: host-local %s: %s: %w", records.ErrBadRequest, dir, name, err)
		}
		out = append(out, adopt.Allocation{Addr: addr.Unmap(), Owner: o, Node: node})
	}
	return out, nil
}

// ParseOwner reads an address file: "containerID\r\nifName" (host-local
// since v0.7). A file with the container ID alone (older host-local) names
// no interface, and is refused: the attachment's key needs it.
func ParseOwner(s string) (records.Owner, error) {
	id, ifName, ok := strings.Cut(s, "\n")
	id, ifName = strings.TrimSpace(id), strings.TrimSpace(ifName)
	switch {
	case id == "":
		return records.Owner{}, errors.New("no container ID")
	case !ok || ifName == "":
		return records.Owner{}, fmt.Errorf("container %s: no interface name (written by a host-local older than v0.7?)", id)
	}
	return records.Owner{ContainerID: id, IfName: ifName}, nil
}

// SourceID names the import of network's host-local state on node.
func SourceID(node, network string) string { return "host-local:" + node + ":" + network }

// Network is the network whose state dir is: the directory's name.
func Network(dir string) string { return filepath.Base(filepath.Clean(dir)) }

// ParseOwnerFile reads one address file.
func ParseOwnerFile(path string) (records.Owner, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return records.Owner{}, err
	}
	o, err := ParseOwner(string(b))
	if err != nil {
		return records.Owner{}, fmt.Errorf("%s: %w", path, err)
	}
	return o, nil
}
