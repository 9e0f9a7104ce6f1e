package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"

	"go.etcd.io/etcd/client/v3/snapshot"
	"go.uber.org/zap"
)

// Backup and restore as an operator does them: etcdctl's snapshot save
// (clientv3's snapshot package, which etcdctl calls) and the real
// etcdutl snapshot restore, built from this module's go.mod (a tool
// dependency) like the etcd binary.

// Snapshot saves member i's database to path, as `etcdctl snapshot save`
// does, and returns the revision it holds.
func (c *Cluster) Snapshot(ctx context.Context, i int, path string) (int64, error) {
	cfg, err := c.ClientV3Config(RootUser, i)
	if err != nil {
		return 0, err
	}
	if _, err := snapshot.SaveWithVersion(ctx, zap.NewNop(), cfg, path); err != nil {
		return 0, fmt.Errorf("snapshot of member %d: %w", i, err)
	}
	st, err := c.Status(ctx, i)
	if err != nil {
		return 0, err
	}
	return st.Header.Revision, nil
}

// RestoreFrom replaces the cluster's data with the snapshot at path, as an
// operator restores a cluster: every member is killed, its data directory
// is made anew by `etcdutl snapshot restore` with --bump-revision bump and
// --mark-compacted (so that watchers see a compaction, not revisions
// going backwards), and the members start again on their names and
// ports. It returns once they are healthy.
func (c *Cluster) RestoreFrom(ctx context.Context, path string, bump uint64) error {
	utl, err := etcdutlBinary()
	if err != nil {
		return err
	}
	for _, m := range c.members {
		if err := m.kill(); err != nil && !errors.Is(err, ErrNotRunning) {
			return err
		}
	}
	for _, m := range c.members {
		if err := os.RemoveAll(m.dataDir); err != nil {
			return fmt.Errorf("remove %s's data: %w", m.name, err)
		}
		args := []string{"snapshot", "restore", path, "--name", m.name, "--data-dir", m.dataDir,
			"--initial-cluster", flagValue(m.args, "--initial-cluster"),
			"--initial-cluster-token", flagValue(m.args, "--initial-cluster-token"),
			"--initial-advertise-peer-urls", m.peerURL,
			"--bump-revision", strconv.FormatUint(bump, 10), "--mark-compacted"}
		if out, err := exec.CommandContext(ctx, utl, args...).CombinedOutput(); err != nil {
			return fmt.Errorf("etcdutl %v: %w\n%s", args, err, out)
		}
	}
	for _, m := range c.members {
		if err := m.start(c.launcher); err != nil {
			return err
		}
		if err := m.waitPeerServing(ctx); err != nil {
			return err
		}
	}
	return c.WaitHealthy(ctx)
}

func flagValue(args []string, name string) string {
	if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}
