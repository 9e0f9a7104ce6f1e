package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
	"github.com/kvipam/kvipam/kvstore"
)

// Environment variables kvipamctl reads when the matching flag is not set.
const (
	envEndpoints = "KVIPAM_ETCD_ENDPOINTS"
	// envPassword keeps the etcd password off the command line, where
	// other users could read it in the process list.
	envPassword = "KVIPAM_ETCD_PASSWORD"
)

// globalFlags are the flags every command takes.
type globalFlags struct {
	endpoints   string
	dialTimeout time.Duration
	timeout     time.Duration
	caFile      string
	certFile    string
	keyFile     string
	user        string
	password    string
	output      string
	socket      string
	progress    string
	pageSize    int
	// retention is --history-retention, used only when retentionSet;
	// otherwise the deletes follow the agents' (historyRecorder).
	retention    time.Duration
	retentionSet bool
}

// app is one run of kvipamctl: its flags, its stdio, and the etcd client
// once a command asked for it. It is not safe for concurrent use.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	now            func() time.Time
	flags          globalFlags
	cli            *clientv3.Client
	cancel         context.CancelFunc
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "kvipamctl",
		Short: "Inspect and repair kvipam's IP allocations in etcd",
		Long: `kvipamctl is the operator CLI of kvipam. It reads and writes etcd directly,
so it works while agents are down. Read commands never change anything;
release and node remove show their plan with --dry-run and delete each key
only if it is unchanged since the plan, logging one audit line per key.

Exit codes: 0 success, 1 check found problems, 2 error.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			a.flags.retentionSet = cmd.Flags().Changed("history-retention")
			if err := a.validate(); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), a.flags.timeout)
			a.cancel = cancel
			cmd.SetContext(ctx)
			return nil
		},
	}
	f := root.PersistentFlags()
	f.StringVar(&a.flags.endpoints, "endpoints", "", "etcd endpoints, comma separated (env "+envEndpoints+")")
	f.DurationVar(&a.flags.dialTimeout, "dial-timeout", kvstore.DefaultDialTimeout, "time to wait for etcd to answer the first request")
	f.DurationVar(&a.flags.timeout, "timeout", 2*time.Minute, "time limit of the whole command")
	f.StringVar(&a.flags.caFile, "cacert", "", "CA bundle that verifies etcd's certificate")
	f.StringVar(&a.flags.certFile, "cert", "", "client certificate for etcd")
	f.StringVar(&a.flags.keyFile, "key", "", "client key for etcd")
	f.StringVar(&a.flags.user, "user", "", "etcd user name")
	f.StringVar(&a.flags.password, "password", "", "etcd password (prefer env "+envPassword+")")
	f.StringVarP(&a.flags.output, "output", "o", "table", "output format: table or json")
	f.StringVar(&a.flags.socket, "socket", client.DefaultSocket, "the local agent's unix socket (agent and endpoint commands)")
	f.StringVar(&a.flags.progress, "progress", "auto", "progress lines on stderr every 10000 keys scanned: auto (when stderr is a terminal), always or never")
	f.IntVar(&a.flags.pageSize, "page-size", 0, "read each etcd prefix in pages of this many keys (0: one range read per prefix)")
	f.DurationVar(&a.flags.retention, "history-retention", 0, "how long IP history keeps the intervals that release, node remove and ip migrate --cut-over end; unset: the agents' --history-retention, which they store in etcd ("+etcdstore.DefaultHistoryRetention.String()+" if none has); 0: record none")
	root.AddCommand(a.poolCmd(), a.claimCmd(), a.blockCmd(), a.ipCmd(), a.nodeCmd(), a.checkCmd(), a.releaseCmd(), a.versionCmd(),
		a.downgradeCmd(), a.agentCmd(), a.endpointCmd(), a.importCmd())
	refuseUnknownSubcommands(root)
	root.Version = buildinfo.Read().String()
	root.SetVersionTemplate("kvipamctl {{.Version}}\n")
	return root
}

func (a *app) validate() error {
	switch a.flags.output {
	case "table", "json":
	default:
		return fmt.Errorf("unknown output format %q: want table or json", a.flags.output)
	}
	switch a.flags.progress {
	case "auto", "always", "never":
	default:
		return fmt.Errorf("unknown --progress %q: want auto, always or never", a.flags.progress)
	}
	if a.flags.timeout <= 0 {
		return fmt.Errorf("--timeout must be positive, got %s", a.flags.timeout)
	}
	if a.flags.retention < 0 {
		return fmt.Errorf("--history-retention must not be negative (0 records none), got %s", a.flags.retention)
	}
	return nil
}

// etcdConfig turns flags and environment into a kvstore.Config.
func (a *app) etcdConfig() (kvstore.Config, error) {
	raw := a.flags.endpoints
	if raw == "" {
		raw = a.getenv(envEndpoints)
	}
	var eps []string
	for _, ep := range strings.Split(raw, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			eps = append(eps, ep)
		}
	}
	if len(eps) == 0 {
		return kvstore.Config{}, fmt.Errorf("no etcd endpoints: pass --endpoints or set %s", envEndpoints)
	}
	pw := a.flags.password
	if pw == "" {
		pw = a.getenv(envPassword)
	}
	c := kvstore.Config{
		Endpoints: eps, DialTimeout: a.flags.dialTimeout,
		CAFile: a.flags.caFile, CertFile: a.flags.certFile, KeyFile: a.flags.keyFile,
		Username: a.flags.user, Password: pw,
	}
	return c, c.Validate()
}

// client connects to etcd on first use.
func (a *app) client(ctx context.Context) (*clientv3.Client, error) {
	if a.cli != nil {
		return a.cli, nil
	}
	cfg, err := a.etcdConfig()
	if err != nil {
		return nil, err
	}
	cli, err := kvstore.Connect(ctx, cfg, etcdstore.HealthKey())
	if err != nil {
		return nil, err
	}
	a.cli = cli
	return cli, nil
}

func (a *app) close() {
	if a.cli != nil {
		a.cli.Close()
	}
	if a.cancel != nil {
		a.cancel()
	}
}

// snapshot connects and reads the whole kvipam state, with progress lines.
// Its inspector records no IP history: see writeSnapshot.
func (a *app) snapshot(ctx context.Context) (*inspect.Inspector, *inspect.Snapshot, error) {
	return a.open(ctx, false)
}

// writeSnapshot is snapshot for a command that deletes: its inspector
// records the IP history of what it deletes (historyRecorder).
func (a *app) writeSnapshot(ctx context.Context) (*inspect.Inspector, *inspect.Snapshot, error) {
	return a.open(ctx, true)
}

func (a *app) open(ctx context.Context, history bool) (*inspect.Inspector, *inspect.Snapshot, error) {
	cli, err := a.client(ctx)
	if err != nil {
		return nil, nil, err
	}
	o := inspect.Options{PageSize: a.flags.pageSize}
	if history {
		if o.History, err = a.historyRecorder(ctx, cli); err != nil {
			return nil, nil, err
		}
	}
	if a.flags.progress == "always" || a.flags.progress == "auto" && isTerminal(a.stderr) {
		o.Progress = func(n int) { fmt.Fprintf(a.stderr, "kvipamctl: scanned %d keys\n", n) }
	}
	in := inspect.New(cli, o)
	s, err := in.Snapshot(ctx)
	if err != nil {
		return nil, nil, err
	}
	return in, s, nil
}

// isTerminal reports whether w is a character device such as a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
