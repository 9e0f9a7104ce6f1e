package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// Namespace bindings: a namespace's default pool, kept in etcd since the
// runtime passes no namespace annotations and kvipam reads no Kubernetes
// API. A pod's own kvipam.io/pool annotation comes first; the binding
// comes before the conflist's pool and the agent's default.
func (a *app) bindingCmds() []*cobra.Command {
	bind := &cobra.Command{
		Use:     "bind-namespace NAMESPACE POOL",
		Short:   "Make POOL the default pool of the pods of NAMESPACE",
		Example: "  kvipamctl pool bind-namespace payments blue",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				if err := s.BindNamespace(cmd.Context(), args[0], args[1]); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "namespace %s: pool %s\n", args[0], args[1])
				p, err := s.GetPool(cmd.Context(), args[1])
				if err != nil {
					return err
				}
				serving, err := servingNodes(cmd.Context(), s, p)
				if err != nil {
					return err
				}
				a.warnUnserved(p, serving, "pods of namespace "+args[0])
				return nil
			})
		},
	}
	unbind := &cobra.Command{
		Use:   "unbind-namespace NAMESPACE",
		Short: "Remove NAMESPACE's default pool",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s operatorStore) error {
				if err := s.UnbindNamespace(cmd.Context(), args[0]); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "namespace %s: no default pool\n", args[0])
				return nil
			})
		},
	}
	list := &cobra.Command{
		Use:   "bindings",
		Short: "List the namespaces' default pools",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return a.bindingsList(cmd.Context(), a.stdout) },
	}
	return []*cobra.Command{bind, unbind, list}
}

func (a *app) bindingsList(ctx context.Context, w io.Writer) error {
	return a.withStore(ctx, func(s operatorStore) error {
		bs, err := s.NamespaceBindings(ctx)
		if err != nil {
			return err
		}
		if bs == nil {
			bs = []etcdstore.NamespaceBinding{}
		}
		type binding struct {
			Namespace string `json:"namespace"`
			etcdstore.NamespaceBinding
		}
		rows := make([]binding, len(bs))
		for i, b := range bs {
			rows[i] = binding{b.Namespace, b}
		}
		return a.render(w, rows, func(tw io.Writer) {
			row(tw, "NAMESPACE", "POOL", "SINCE")
			for _, r := range rows {
				row(tw, r.Namespace, r.Pool, r.Since)
			}
		})
	})
}

// withStore runs f with a store on the configured etcd, seen as the
// methods kvipamctl uses (operatorStore). kvipamctl writes
// no history through it and bounds its calls by the command's context
// only (a large history read may take longer than a call timeout).
func (a *app) withStore(ctx context.Context, f func(operatorStore) error) error {
	cli, err := a.client(ctx)
	if err != nil {
		return err
	}
	return f(etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1}))
}
