// Package delqueue is the on-disk queue of CNI DELs that could not reach
// the kvipam agent. A plugin whose agent is down enqueues the attachment's
// owner and reports success, so the runtime moves on; the agent drains the
// queue when it starts, so the owner's IPs do not leak.
//
// Each owner is one small JSON file named by a hash of (container ID,
// interface name), written to a temporary file and renamed into place, so
// a reader never sees half a file and a repeated DEL of the same
// attachment collapses into one entry. Enqueue and Drain are safe to call
// from separate processes at once. An entry no Drain can read is moved to
// the queue's RejectedDir and reported once.
//
// The file format is a contract between the plugins, which write it, and
// the agent, which drains it; like the API in agent/api it lives with the
// agent, and the plugins import it.
package delqueue

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/internal/foundation/atomicfile"
)

// Entry is one queued DEL.
type Entry struct {
	Owner api.Owner `json:"owner"`
	// Sticky and IPClaim are the DEL's (api.ReleaseRequest's): with the
	// owner's namespace and pod, the sticky identity the release names,
	// so that a binding naming the owner goes with it even when the
	// agent has no endpoint of it (an ADD that died before its endpoint
	// was made: a live migration's target admitted as the alternate).
	Sticky  string `json:"sticky,omitempty"`
	IPClaim string `json:"ipClaim,omitempty"`
	// QueuedAt is when the DEL was queued. An allocation made after it
	// belongs to a later attachment that reused the same container ID and
	// interface name, and must not be released by this entry.
	QueuedAt time.Time `json:"queuedAt"`
}

const (
	suffix    = ".json"
	tmpPrefix = atomicfile.TmpPrefix
	// claimPrefix marks an entry a Drain is releasing.
	claimPrefix = ".drain-"
	// staleTmp is how old a temporary file must be before Drain removes
	// it: older than any Enqueue still writing it.
	staleTmp = 10 * time.Minute
	// RejectedDir is the subdirectory of a queue that holds the entries
	// no Drain can read (not JSON, no owner), kept as they were for a
	// person to look at.
	RejectedDir = "rejected"
)

var (
	// ErrRejected marks an entry Drain moved to RejectedDir: Drain
	// reports it once, and the queue no longer lists it.
	ErrRejected = errors.New("delqueue: entry rejected")
	// errMalformed marks an entry that no later read will make sense of.
	errMalformed = errors.New("malformed")
)

// FileName is the queue file of an owner: the same (container ID,
// interface name) always gives the same name.
func FileName(o api.Owner) string {
	h := sha256.Sum256([]byte(o.Key()))
	return hex.EncodeToString(h[:16]) + suffix
}

// Enqueue records a DEL of o in dir, creating dir if needed. The entry is
// durable when Enqueue returns: the file and the directory are synced.
func Enqueue(dir string, o api.Owner) error {
	return EnqueueRelease(dir, api.ReleaseRequest{Owner: o})
}

// EnqueueRelease records req, a DEL the agent could not be sent, as
// Enqueue does, with the sticky identity it names (Sticky, IPClaim).
func EnqueueRelease(dir string, req api.ReleaseRequest) error {
	o := req.Owner
	if o.ContainerID == "" || o.IfName == "" {
		return fmt.Errorf("queue DEL: owner needs a container ID and an interface name")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("queue DEL: create %s: %w", dir, err)
	}
	data, err := json.Marshal(Entry{Owner: o, Sticky: req.Sticky, IPClaim: req.IPClaim, QueuedAt: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("queue DEL: encode: %w", err)
	}
	if err := atomicfile.Write(dir, FileName(o), data, 0o600); err != nil {
		return fmt.Errorf("queue DEL of %s: %w", o.Key(), err)
	}
	return nil
}

// List returns the queued entries, and the errors of entries it could
// not read (which it leaves in place).
func List(dir string) ([]Entry, error) {
	files, err := queued(dir)
	var out []Entry
	errs := []error{err}
	for _, f := range files {
		e, err := read(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, e)
	}
	return out, errors.Join(errs...)
}

// Pending reports whether dir holds a queued DEL (one directory read).
func Pending(dir string) (bool, error) {
	files, err := queued(dir)
	return len(files) > 0, err
}

// queued lists the entry files in dir, including those a Drain had
// claimed when it was killed.
func queued(dir string) ([]string, error) {
	des, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list DEL queue %s: %w", dir, err)
	}
	var out []string
	for _, de := range des {
		name := de.Name()
		if !de.Type().IsRegular() || !strings.HasSuffix(name, suffix) ||
			(strings.HasPrefix(name, ".") && !strings.HasPrefix(name, claimPrefix)) {
			continue
		}
		out = append(out, filepath.Join(dir, name))
	}
	return out, nil
}

// Drain calls release for every queued owner and removes an entry only
// when its release succeeded, so a failed one is retried by the next
// Drain. It returns how many entries it removed, and every error it met;
// it stops early only when ctx ends.
func Drain(ctx context.Context, dir string, release func(context.Context, api.Owner) error) (int, error) {
	return DrainEntries(ctx, dir, func(ctx context.Context, e Entry) error { return release(ctx, e.Owner) })
}

// DrainEntries is Drain with the whole entry, for a caller that wants
// QueuedAt.
//
// Each entry is first claimed by renaming it, so a DEL of the same owner
// queued while its release runs makes a new entry instead of being
// removed with the old one.
func DrainEntries(ctx context.Context, dir string, release func(context.Context, Entry) error) (int, error) {
	files, err := queued(dir)
	errs := []error{err}
	done := 0
	for _, f := range files {
		if err := ctx.Err(); err != nil {
			errs = append(errs, fmt.Errorf("drain DEL queue: %w", err))
			break
		}
		ok, err := drainOne(ctx, f, release)
		if err != nil {
			errs = append(errs, err)
		}
		if ok {
			done++
		}
	}
	removeStaleTemps(dir)
	return done, errors.Join(errs...)
}

func drainOne(ctx context.Context, path string, release func(context.Context, Entry) error) (bool, error) {
	dir, name := filepath.Split(path)
	claimed := path
	if !strings.HasPrefix(name, claimPrefix) {
		claimed = filepath.Join(dir, claimPrefix+name)
		if err := os.Rename(path, claimed); errors.Is(err, os.ErrNotExist) {
			return false, nil // drained by someone else
		} else if err != nil {
			return false, fmt.Errorf("claim queued DEL %s: %w", path, err)
		}
	}
	e, err := read(claimed)
	if errors.Is(err, errMalformed) {
		return false, reject(claimed, err)
	}
	if err != nil {
		return false, err
	}
	if err := release(ctx, e); err != nil {
		// Put it back for the next Drain, unless a newer DEL of the same
		// owner took the name meanwhile: that one supersedes it.
		orig := filepath.Join(dir, strings.TrimPrefix(filepath.Base(claimed), claimPrefix))
		if rerr := unix.Renameat2(unix.AT_FDCWD, claimed, unix.AT_FDCWD, orig, unix.RENAME_NOREPLACE); errors.Is(rerr, unix.EEXIST) {
			_ = os.Remove(claimed)
		}
		return false, fmt.Errorf("release queued %s: %w", e.Owner.Key(), err)
	}
	if err := os.Remove(claimed); err != nil && !errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("remove queued DEL %s: %w", claimed, err)
	}
	return true, nil
}

func read(path string) (Entry, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Entry{}, fmt.Errorf("read queued DEL: %w", err)
	}
	var e Entry
	if err := json.Unmarshal(data, &e); err != nil {
		return Entry{}, fmt.Errorf("queued DEL %s: %w: %w", path, errMalformed, err)
	}
	if e.Owner.ContainerID == "" || e.Owner.IfName == "" {
		return Entry{}, fmt.Errorf("queued DEL %s: %w: no container ID or interface name", path, errMalformed)
	}
	return e, nil
}

// reject moves a claimed entry no Drain can read into RejectedDir under
// its own name: left in the queue it would keep Pending true, and the
// agent would retry and warn about it on every look. The error it
// returns, wrapping ErrRejected, is the one report of the entry.
func reject(claimed string, why error) error {
	dir, name := filepath.Split(claimed)
	rejected := filepath.Join(dir, RejectedDir)
	if err := os.MkdirAll(rejected, 0o700); err != nil {
		return errors.Join(why, fmt.Errorf("reject queued DEL: %w", err))
	}
	to := filepath.Join(rejected, strings.TrimPrefix(name, claimPrefix))
	if err := os.Rename(claimed, to); err != nil {
		return errors.Join(why, fmt.Errorf("reject queued DEL: %w", err))
	}
	return fmt.Errorf("%w, moved to %s: %w", ErrRejected, to, why)
}

// removeStaleTemps removes temporary files a crashed Enqueue left.
func removeStaleTemps(dir string) {
	des, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, de := range des {
		if !strings.HasPrefix(de.Name(), tmpPrefix) {
			continue
		}
		if fi, err := de.Info(); err == nil && time.Since(fi.ModTime()) > staleTmp {
			_ = os.Remove(filepath.Join(dir, de.Name()))
		}
	}
}
