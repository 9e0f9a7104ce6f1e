// Command kvipam-demo walks through kvipam on an embedded etcd. First the
// agent: it starts, a CNI-style client asks it for addresses over its unix
// socket, and the etcd keys are shown. Then the allocator under failure:
// nodes claim blocks, a node's lease ends and its blocks become orphaned
// (never free), and the node comes back with every address intact.
// `make demo` runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"strings"
	"text/tabwriter"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

func main() {
	dir := flag.String("data-dir", "", "etcd data dir (default: a temporary dir, removed at exit)")
	flag.Parse()
	if err := runAgent(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	if err := run(context.Background(), os.Stdout, *dir); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

type node struct {
	name  string
	cli   *clientv3.Client
	sess  *kvstore.Session
	alloc *nodealloc.Allocator
}

func startNode(ctx context.Context, e *kvstore.Embedded, name string) (*node, error) {
	cli, err := e.Client(ctx)
	if err != nil {
		return nil, err
	}
	sess, err := kvstore.NewSession(ctx, cli, 10)
	if err != nil {
		return nil, err
	}
	al, err := nodealloc.New(nodealloc.Config{Node: name, Store: etcdstore.New(cli, etcdstore.Options{})})
	if err != nil {
		return nil, err
	}
	if err := al.Restore(ctx, sess); err != nil {
		return nil, err
	}
	return &node{name: name, cli: cli, sess: sess, alloc: al}, nil
}

func (n *node) close() {
	n.sess.Close()
	n.cli.Close()
}

func run(ctx context.Context, w io.Writer, dir string) error {
	if dir == "" {
		tmp, err := os.MkdirTemp("", "kvipam-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	step(w, "start an embedded etcd in %s", dir)
	e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: dir})
	if err != nil {
		return err
	}
	defer e.Close()
	cli, err := e.Client(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()

	pool := allocator.Pool{Name: "default", BlockSizeV4: 28, BlockSizeV6: 120, CIDRs: []netip.Prefix{
		netip.MustParsePrefix("10.244.0.0/24"), netip.MustParsePrefix("fd00:244::/64")}}
	step(w, "create pool %s %v, blocks /%d and /%d", pool.Name, pool.CIDRs, pool.BlockSizeV4, pool.BlockSizeV6)
	if _, err := etcdstore.New(cli, etcdstore.Options{}).EnsurePool(ctx, pool); err != nil {
		return err
	}

	a, err := startNode(ctx, e, "node-a")
	if err != nil {
		return err
	}
	b, err := startNode(ctx, e, "node-b")
	if err != nil {
		return err
	}
	defer b.close()

	step(w, "node-a starts 20 pods, node-b starts 3 (dual-stack: one IPv4 and one IPv6 each)")
	held := map[string][]netip.Addr{}
	for i := range 23 {
		n := a
		if i >= 20 {
			n = b
		}
		o := records.Owner{ContainerID: fmt.Sprintf("c%02d", i), IfName: "eth0", Namespace: "demo", Pod: fmt.Sprintf("pod-%02d", i)}
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "default", Owner: o})
		if err != nil {
			return err
		}
		for _, al := range r.Allocations {
			held[o.ContainerID] = append(held[o.ContainerID], al.Addr)
		}
		if i < 3 || i >= 20 {
			fmt.Fprintf(w, "  %s %s/%s -> %v\n", n.name, o.Namespace, o.Pod, held[o.ContainerID])
		} else if i == 3 {
			fmt.Fprintln(w, "  ...")
		}
	}
	if err := dumpBlocks(ctx, w, cli); err != nil {
		return err
	}
	step(w, "one key per IP, JSON values (etcdctl get --prefix %s):", etcdstore.IPsPrefix("default"))
	if err := dumpKeys(ctx, w, cli, etcdstore.IPsPrefix("default"), 4); err != nil {
		return err
	}

	step(w, "node-a's lease ends (as if it was partitioned from etcd past its TTL)")
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(a.sess.ID())); err != nil {
		return err
	}
	a.close()
	if err := dumpBlocks(ctx, w, cli); err != nil {
		return err
	}
	step(w, "node-b fills the rest of the pool; node-a's orphaned blocks are never handed out")
	for i := 100; ; i++ {
		o := records.Owner{ContainerID: fmt.Sprintf("b%03d", i), IfName: "eth0"}
		_, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "default", Owner: o, Families: []allocator.Family{allocator.IPv4}})
		var ee *records.ExhaustedError
		if errors.As(err, &ee) {
			fmt.Fprintf(w, "  node-b stopped after %d more pods: %v\n", i-100, err)
			break
		}
		if err != nil {
			return err
		}
	}

	step(w, "node-a restarts: it re-claims its blocks and every pod keeps its addresses")
	a, err = startNode(ctx, e, "node-a")
	if err != nil {
		return err
	}
	defer a.close()
	same := 0
	for i := range 20 {
		o := records.Owner{ContainerID: fmt.Sprintf("c%02d", i), IfName: "eth0"}
		got := a.alloc.Lookup(o)
		if len(got) == 2 && got[0].Addr == held[o.ContainerID][0] && got[1].Addr == held[o.ContainerID][1] {
			same++
		}
	}
	fmt.Fprintf(w, "  %d of 20 pods on node-a kept both addresses\n", same)
	if same != 20 {
		return fmt.Errorf("node-a lost addresses across its restart")
	}
	return dumpBlocks(ctx, w, cli)
}

func step(w io.Writer, format string, args ...any) {
	fmt.Fprintf(w, "\n==> "+format+"\n", args...)
}

func dumpBlocks(ctx context.Context, w io.Writer, cli *clientv3.Client) error {
	st := etcdstore.New(cli, etcdstore.Options{})
	infos, err := st.ListBlocks(ctx, "default")
	if err != nil {
		return err
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].Block.Addr().Less(infos[j].Block.Addr()) })
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  BLOCK\tCLAIM\tHOME\tIPS\tSTATE")
	for _, bi := range infos {
		ips, err := st.ListIPs(ctx, "default", bi.Block)
		if err != nil {
			return err
		}
		claim, home, state := "-", "-", "claimed"
		if bi.Claim != nil {
			claim = bi.Claim.Node
		}
		if bi.Home != nil {
			home = bi.Home.Node
		}
		if bi.Claim == nil {
			state = "free"
			if len(ips) > 0 {
				state = "orphaned"
			}
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\n", bi.Block, claim, home, len(ips), state)
	}
	return tw.Flush()
}

func dumpKeys(ctx context.Context, w io.Writer, cli *clientv3.Client, prefix string, limit int64) error {
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithLimit(limit))
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		fmt.Fprintf(w, "  %s\n    %s\n", kv.Key, strings.TrimSpace(string(kv.Value)))
	}
	fmt.Fprintf(w, "  ... (%d keys in all)\n", resp.Count)
	return nil
}
