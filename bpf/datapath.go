//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"github.com/hashicorp/go-hclog"
	"github.com/kvipam/kvipam/internal/foundation/keylock"
	"golang.org/x/sys/unix"
)

// DefaultPinDir is where the agent keeps its maps and links.
const DefaultPinDir = "/sys/fs/bpf/kvipam"

// linksDir is the subdirectory of the pin directory holding one TCX link per
// host interface, named by ifindex.
const linksDir = "links"

// Datapath owns the loaded program and maps and the pins under one directory.
//
// It is safe for concurrent use: calls on different host interfaces run at
// once, calls on the same interface one after another, and Close,
// SetAttachMode and Adopt wait for the others (locks.go). Attach, Detach
// and Adopt resolve interface indexes in the network namespace of the
// calling thread, which must be the one holding the host-side veths (use
// ns.Do from containernetworking's pkg/ns for another).
type Datapath struct {
	log    hclog.Logger
	pinDir string

	// mu is held shared by calls on one endpoint, which also hold the
	// lock of its ifindex in ifLocks, and exclusively by whole-datapath
	// calls.
	mu      sync.RWMutex
	ifLocks keylock.Map[int]
	// mapsMu serializes the map sections of calls holding mu shared.
	mapsMu sync.Mutex
	// owners mirrors the addrs and ifaces maps (owners.go); read and
	// written like them.
	owners owners

	objs    kvipamObjects
	progID  ebpf.ProgramID
	progTag string
	mapIDs  []ebpf.MapID // sorted; with progTag, tells an adopted program is ours
	// mode is how endpoints that do not say are attached (SetAttachMode);
	// written with mu held exclusively.
	mode string
	// noTCX is set once the kernel refused a TCX attach as unsupported:
	// from then on endpoints are attached with a clsact filter.
	noTCX  atomic.Bool
	closed bool
	// readerState is the open announcement reader (announce.go); Close
	// closes it.
	readerState
}

// Open loads the program and maps, reusing maps already pinned under pinDir
// so that endpoints and counters survive an agent restart. pinDir must be on
// bpffs; it is created if missing. A nil log discards messages.
//
// Open removes the process's memlock rlimit, which kernels before 5.11 charge
// BPF maps against.
func Open(pinDir string, log hclog.Logger) (*Datapath, error) {
	if log == nil {
		log = hclog.NewNullLogger()
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("remove memlock rlimit: %w", err)
	}
	if err := os.MkdirAll(pinDir, 0o700); err != nil {
		return nil, fmt.Errorf("create pin dir: %w", err)
	}
	if err := checkBPFFS(pinDir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(pinDir, linksDir), 0o700); err != nil {
		return nil, fmt.Errorf("create links dir: %w", err)
	}

	d := &Datapath{log: log, pinDir: pinDir, mode: AttachTCX}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pinDir}}
	if err := loadKvipamObjects(&d.objs, opts); err != nil {
		return nil, fmt.Errorf("load ebpf objects: %w", err)
	}
	if err := d.init(); err != nil {
		return nil, errors.Join(err, d.objs.Close())
	}
	log.Debug("datapath open", "pin_dir", pinDir, "prog_id", d.progID, "prog_tag", d.progTag)
	return d, nil
}

func (d *Datapath) init() error {
	info, err := d.objs.KvipamIngress.Info()
	if err != nil {
		return fmt.Errorf("program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return errors.New("program info: kernel reports no program ID")
	}
	maps, ok := info.MapIDs()
	if !ok {
		return errors.New("program info: kernel reports no map IDs")
	}
	slices.Sort(maps)
	d.progID, d.progTag, d.mapIDs = id, info.Tag, maps
	if err := d.loadOwners(); err != nil {
		return err
	}
	// Counter 0 collects frames seen on an interface with no endpoint.
	if _, err := d.ensureCounters(0); err != nil {
		return err
	}
	return nil
}

func checkBPFFS(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs pin dir: %w", err)
	}
	if uint32(st.Type) != unix.BPF_FS_MAGIC {
		return fmt.Errorf("pin dir %s is not on bpffs (mount -t bpf bpf /sys/fs/bpf)", dir)
	}
	return nil
}

func (d *Datapath) linkPin(ifindex int) string {
	return filepath.Join(d.pinDir, linksDir, strconv.Itoa(ifindex))
}

// Close releases the process's file descriptors. It does not unpin anything:
// attached programs keep enforcing, and the maps keep their entries, until a
// new Datapath adopts them. Close is idempotent.
func (d *Datapath) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	if err := d.closeReader(); err != nil {
		errs = append(errs, err)
	}
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close ebpf objects: %w", err))
	}
	return errors.Join(errs...)
}
