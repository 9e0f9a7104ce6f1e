package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// The writes of kvipamctl import (records.Importer): one transaction per
// block, its claim with its records and the import marks that each
// node's agent watches (ImportMarksPrefix) to learn what was written for
// it; and the finalize, which drops a source's marks.

var _ records.Importer = (*Store)(nil)

// AllImportMarksPrefix holds every node's import marks.
func AllImportMarksPrefix() string { return Prefix + "imports/" }

// ImportMarksPrefix holds node's import marks: the agent of node watches it.
func ImportMarksPrefix(node string) string { return AllImportMarksPrefix() + node + "/" }

// ImportMarkKey is the mark of what source imported for node into block of pool.
func ImportMarkKey(node, source, pool string, b netip.Prefix) string {
	return ImportMarksPrefix(node) + source + "/" + pool + "/" + allocator.BlockName(b)
}

// importsFinalizedPrefix holds a record per finalized source.
func importsFinalizedPrefix() string { return Prefix + "imports-finalized/" }

// ImportFinalized is the record finalize leaves of a source: when, and
// how many marks it dropped.
type ImportFinalized struct {
	Source string    `json:"source"`
	At     time.Time `json:"at"`
	Marks  int       `json:"marks"`
	Addrs  int       `json:"addrs"`
}

// ImportBlock implements records.Importer. The transaction compares: the
// cluster's schema level includes the import feature (every live agent
// learns imports), the claimant's node record is on b.Lease, the pool
// spec is at b.PoolRev, the block unclaimed and empty (b.ClaimRev 0) or
// the claim at b.ClaimRev, each new address free, each borrower's fence
// at its revision, and each mark at its revision. Then it puts the claim
// and home (a new claim), the records, the lent homes of borrowed
// addresses and the marks.
func (s *Store) ImportBlock(ctx context.Context, b records.ImportBlock) (int64, error) {
	what := fmt.Sprintf("import block %s of pool %s for node %s", b.Block, b.Pool, b.Claimant)
	if puts, cmps := b.Ops(); puts > maxTxnOps || cmps > maxTxnOps {
		return 0, fmt.Errorf("%w: %s: %d puts and %d compares, etcd takes %d of each in one transaction (use a smaller block size)",
			records.ErrImportTooBig, what, puts, cmps, maxTxnOps)
	}
	set, err := s.ReadSchema(ctx)
	if err != nil {
		return 0, err
	}
	if need := importNeeds(); set.Level < need {
		return 0, fmt.Errorf("%w: %s needs %s (level %d), and the cluster runs at level %d: a node runs a version that does not learn imports, or a downgrade holds the level",
			ErrSchemaLevel, what, schema.Import, need, set.Level)
	}
	ck, hk := ClaimKey(b.Pool, b.Block), HomeKey(b.Pool, b.Block)
	cmps := []clientv3.Cmp{settingUnchanged(set), nodeOnLease(b.Claimant, b.Lease), kvstore.Unchanged(PoolKey(b.Pool), b.PoolRev)}
	var puts []clientv3.Op
	if b.ClaimRev == 0 {
		cmps = append(cmps, kvstore.Absent(ck), kvstore.PrefixEmpty(BlockIPsPrefix(b.Pool, b.Block)))
		now := s.now()
		claim, err := kvstore.EncodeJSON(records.Claim{Node: b.Claimant, BootID: b.BootID, ClaimedAt: now})
		if err != nil {
			return 0, err
		}
		home, err := kvstore.EncodeJSON(records.Home{Node: b.Claimant, Since: now})
		if err != nil {
			return 0, err
		}
		puts = append(puts, clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(b.Lease))), clientv3.OpPut(hk, home))
	} else {
		cmps = append(cmps, kvstore.Unchanged(ck, b.ClaimRev), clientv3.Compare(clientv3.LeaseValue(ck), "=", b.Lease))
	}
	for n, f := range b.Borrowers {
		cmps = append(cmps, kvstore.Unchanged(borrowerKey(n), f.Rev))
	}
	for _, ip := range b.IPs {
		if !b.Block.Contains(ip.Addr) || ip.Record.Imported == "" || ip.Record.State != records.StateAllocated {
			return 0, fmt.Errorf("%w: %s: %s is not an imported allocation of the block", records.ErrBadRequest, what, ip.Addr)
		}
		key := IPKey(b.Pool, b.Block, ip.Addr)
		if b.ClaimRev != 0 {
			cmps = append(cmps, kvstore.Absent(key))
		}
		val, err := kvstore.EncodeJSON(ip.Record)
		if err != nil {
			return 0, err
		}
		puts = append(puts, clientv3.OpPut(key, val))
		if ip.Record.Borrowed {
			if _, ok := b.Borrowers[ip.Record.Node]; !ok {
				return 0, fmt.Errorf("%w: %s: borrowed %s of node %s has no fence", records.ErrBadRequest, what, ip.Addr, ip.Record.Node)
			}
			lk := LentKey(b.Pool, ip.Addr)
			home, err := kvstore.EncodeJSON(records.Home{Node: ip.Record.Node, Since: ip.Record.Since})
			if err != nil {
				return 0, err
			}
			cmps = append(cmps, kvstore.Absent(lk))
			puts = append(puts, clientv3.OpPut(lk, home))
		}
	}
	for _, m := range b.Marks {
		key := ImportMarkKey(m.Node, m.Source, m.Pool, m.Block)
		val, err := kvstore.EncodeJSON(m)
		if err != nil {
			return 0, err
		}
		cmps = append(cmps, kvstore.Unchanged(key, m.Rev))
		puts = append(puts, clientv3.OpPut(key, val))
	}
	resp, err := s.claims.Txn(ctx).If(cmps...).Then(puts...).Else(clientv3.OpGet(NodeKey(b.Claimant))).Commit()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, leaseErr(kvstore.Unavailable(err)))
	}
	if !resp.Succeeded {
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) == 0 || kvs[0].Lease != b.Lease {
			return 0, fmt.Errorf("%s: the node's agent is not on lease %x any more (restarted or gone): %w", what, b.Lease, errors.Join(records.ErrLeaseLost, retry.ErrConflict))
		}
		return 0, fmt.Errorf("%s: the block, an address, a fence, a mark, the pool or the schema level changed since the plan: %w", what, retry.ErrConflict)
	}
	return resp.Header.Revision, nil
}

// nodeOnLease compares that node's record is on lease: its agent is the
// one whose lease the import writes on.
func nodeOnLease(node string, lease int64) clientv3.Cmp {
	return clientv3.Compare(clientv3.LeaseValue(NodeKey(node)), "=", lease)
}

// importNeeds is the level an import needs.
func importNeeds() schema.Level { return schema.ImportNeeds() }

// ListImportMarks implements records.Importer.
func (s *Store) ListImportMarks(ctx context.Context) ([]records.ImportMark, error) {
	resp, err := s.kv.Get(ctx, AllImportMarksPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list import marks: %w", kvstore.Unavailable(err))
	}
	out := make([]records.ImportMark, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		v, err := kvstore.Decode[records.ImportMark](kv)
		if err != nil {
			return nil, fmt.Errorf("import mark %s: %w", kv.Key, err)
		}
		v.Value.Rev = kv.ModRevision
		out = append(out, v.Value)
	}
	return out, nil
}

// ListImportsFinalized reads the record of every finalized source.
func (s *Store) ListImportsFinalized(ctx context.Context) ([]ImportFinalized, error) {
	resp, err := s.kv.Get(ctx, importsFinalizedPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list finalized imports: %w", kvstore.Unavailable(err))
	}
	var out []ImportFinalized
	for _, kv := range resp.Kvs {
		v, err := kvstore.Decode[ImportFinalized](kv)
		if err != nil {
			return nil, fmt.Errorf("finalized import %s: %w", kv.Key, err)
		}
		out = append(out, v.Value)
	}
	return out, nil
}

// FinalizeImport implements records.Importer: the marks of source are
// deleted, each at the revision read (a block imported again meanwhile
// is read again), and the finalized record written, in one transaction
// per up to maxTxnOps-1 marks; a rerun finishes what a crash left.
func (s *Store) FinalizeImport(ctx context.Context, source string) ([]records.ImportMark, error) {
	if source == "" || strings.Contains(source, "/") {
		return nil, fmt.Errorf("%w: import source %q: empty or with a slash", records.ErrBadRequest, source)
	}
	var dropped []records.ImportMark
	err := retry.Do(ctx, retry.Default, func(ctx context.Context) error {
		all, err := s.ListImportMarks(ctx)
		if err != nil {
			return err
		}
		mine := slices.DeleteFunc(all, func(m records.ImportMark) bool { return m.Source != source })
		for chunk := range slices.Chunk(mine, maxTxnOps-1) {
			var cmps []clientv3.Cmp
			var ops []clientv3.Op
			for _, m := range chunk {
				key := ImportMarkKey(m.Node, m.Source, m.Pool, m.Block)
				cmps = append(cmps, kvstore.Unchanged(key, m.Rev))
				ops = append(ops, clientv3.OpDelete(key))
			}
			resp, err := s.kv.Txn(ctx).If(cmps...).Then(ops...).Commit()
			if err != nil {
				return fmt.Errorf("finalize import %s: %w", source, kvstore.Unavailable(err))
			}
			if !resp.Succeeded {
				return fmt.Errorf("finalize import %s: a mark changed (imported again meanwhile): %w", source, retry.ErrConflict)
			}
			dropped = append(dropped, chunk...)
		}
		return nil
	})
	if err != nil {
		return dropped, err
	}
	addrs := 0
	for _, m := range dropped {
		addrs += len(m.Addrs)
	}
	val, err := kvstore.EncodeJSON(ImportFinalized{Source: source, At: s.now().UTC(), Marks: len(dropped), Addrs: addrs})
	if err != nil {
		return dropped, err
	}
	if _, err := s.kv.Put(ctx, importsFinalizedPrefix()+source, val); err != nil {
		return dropped, fmt.Errorf("finalize import %s: record it: %w", source, kvstore.Unavailable(err))
	}
	return dropped, nil
}

// WatchImportMarks lists node's import marks, then follows their changes
// until ctx ends, as WatchHomes does. A deleted mark (finalize) names
// nothing but is passed on with only Node set.
func (s *Store) WatchImportMarks(ctx context.Context, node string, h Handler[records.ImportMark]) error {
	return s.follow(ctx, ImportMarksPrefix(node), decoded[records.ImportMark]{h: h,
		decode: func(kv *mvccpb.KeyValue) (records.ImportMark, bool) {
			v, err := kvstore.Decode[records.ImportMark](kv)
			v.Value.Rev = kv.ModRevision
			return v.Value, err == nil && v.Value.Node == node
		},
		fromKey: func(string) (records.ImportMark, bool) { return records.ImportMark{Node: node}, true },
	})
}

// BorrowFences reads every node's borrow fence (FenceBorrower), with
// its revision and the lease it is on.
func (s *Store) BorrowFences(ctx context.Context) (map[string]records.BorrowFence, error) {
	prefix := borrowerKey("")
	resp, err := s.kv.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list borrow fences: %w", kvstore.Unavailable(err))
	}
	out := map[string]records.BorrowFence{}
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), prefix)] = records.BorrowFence{Rev: kv.ModRevision, Lease: kv.Lease}
	}
	return out, nil
}
