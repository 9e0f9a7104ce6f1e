package agent

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/internal/foundation/atomicfile"
)

// endpointRecords keeps the node's endpoint records on local disk, one JSON
// file per endpoint, written atomically. Endpoints are node-local (a veth,
// an eBPF attachment), so they live next to the datapath, not in etcd; the
// IPs they use are in etcd. It is safe for concurrent use.
type endpointRecords struct {
	dir    string
	mu     sync.Mutex
	eps    map[string]api.Endpoint // by owner key
	nextID uint32
}

// releasingDir is the subdirectory of the records' dir that holds the
// notes of releases that have not landed (noteReleasing).
const releasingDir = "releasing"

// openEndpointRecords loads every record in dir.
func openEndpointRecords(dir string) (*endpointRecords, error) {
	if err := os.MkdirAll(filepath.Join(dir, releasingDir), 0o700); err != nil {
		return nil, fmt.Errorf("create endpoint dir: %w", err)
	}
	s := &endpointRecords{dir: dir, eps: map[string]api.Endpoint{}, nextID: 1}
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var ep api.Endpoint
		if err := json.Unmarshal(data, &ep); err != nil {
			errs = append(errs, fmt.Errorf("endpoint record %s: %w", f, err))
			continue
		}
		s.eps[ep.Owner.Key()] = ep
		s.nextID = max(s.nextID, ep.ID+1)
	}
	return s, errors.Join(errs...)
}

func (s *endpointRecords) file(o api.Owner) string {
	h := sha256.Sum256([]byte(o.Key()))
	return filepath.Join(s.dir, hex.EncodeToString(h[:12])+".json")
}

// get returns the endpoint of an owner.
func (s *endpointRecords) get(o api.Owner) (api.Endpoint, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ep, ok := s.eps[o.Key()]
	return ep, ok
}

// assignID gives ep its ID: the existing one for a known owner, else a new one.
func (s *endpointRecords) assignID(ep *api.Endpoint) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, ok := s.eps[ep.Owner.Key()]; ok {
		ep.ID = old.ID
		return
	}
	ep.ID = s.nextID
	s.nextID++
}

// put writes ep, then indexes it. The record replaces the old one
// atomically for an agent restarted after a crash, but is not synced: an
// endpoint does not outlive the boot (its veth, netns and eBPF attachment
// go with it), so after a power loss no pod of a lost record runs, and
// the record, if left, is stale as any endpoint whose veth is gone. An
// fsync here was half of the record's cost and a wait on the journal in
// every ADD.
func (s *endpointRecords) put(ep api.Endpoint) error {
	data, err := json.MarshalIndent(ep, "", "  ")
	if err != nil {
		return fmt.Errorf("encode endpoint: %w", err)
	}
	if err := atomicfile.Replace(s.dir, filepath.Base(s.file(ep.Owner)), data, 0o600); err != nil {
		return fmt.Errorf("save endpoint record: %w", err)
	}
	s.mu.Lock()
	s.eps[ep.Owner.Key()] = ep
	s.mu.Unlock()
	return nil
}

// remove deletes the owner's record; absent is fine.
func (s *endpointRecords) remove(o api.Owner) error {
	if err := os.Remove(s.file(o)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove endpoint record: %w", err)
	}
	s.mu.Lock()
	delete(s.eps, o.Key())
	s.mu.Unlock()
	return nil
}

// list returns every endpoint ordered by ID.
func (s *endpointRecords) list() []api.Endpoint {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]api.Endpoint, 0, len(s.eps))
	for _, ep := range s.eps {
		out = append(out, ep)
	}
	slices.SortFunc(out, func(a, b api.Endpoint) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// addrs are every endpoint's addresses. It takes only the records' lock,
// so the allocator may call it while holding its own (nodealloc.Config.Held).
func (s *endpointRecords) addrs() []netip.Addr {
	var out []netip.Addr
	for _, ep := range s.list() {
		out = append(out, ep.IPs...)
	}
	return out
}

// releasing is the note of a release that has not landed: the sticky
// identity the owner's DEL names (its endpoint's, or the request's).
type releasing struct {
	Owner    api.Owner `json:"owner"`
	Identity string    `json:"identity"`
	Since    time.Time `json:"since"`
}

// noteReleasing saves durably that o is released under sticky identity
// id, before the DEL removes anything of o: until released says its
// release landed, a DEL of o that names no identity (a retry after the
// endpoint record went, after a restart) still names id. The note is a
// file of its own (releasingDir), never read as an endpoint.
func (s *endpointRecords) noteReleasing(o api.Owner, id string) error {
	data, err := json.Marshal(releasing{Owner: o, Identity: id, Since: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("encode release note: %w", err)
	}
	if err := atomicfile.Write(filepath.Join(s.dir, releasingDir), filepath.Base(s.file(o)), data, 0o600); err != nil {
		return fmt.Errorf("save the sticky identity of %s's release: %w", o.Key(), err)
	}
	return nil
}

// releasingAs is the sticky identity an earlier release of o that has not
// landed was noted under, or "".
func (s *endpointRecords) releasingAs(o api.Owner) (string, error) {
	data, err := os.ReadFile(filepath.Join(s.dir, releasingDir, filepath.Base(s.file(o))))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read the release note of %s: %w", o.Key(), err)
	}
	var r releasing
	if err := json.Unmarshal(data, &r); err != nil {
		return "", fmt.Errorf("release note of %s: %w", o.Key(), err)
	}
	return r.Identity, nil
}

// released drops o's release note: its release landed. Absent is fine.
func (s *endpointRecords) released(o api.Owner) error {
	if err := os.Remove(filepath.Join(s.dir, releasingDir, filepath.Base(s.file(o)))); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the release note of %s: %w", o.Key(), err)
	}
	return nil
}
