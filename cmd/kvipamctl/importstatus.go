package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator/adopt/hostlocal"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// importLine is one line of import status: a source's import for one
// node in one pool.
type importLine struct {
	Source string `json:"source"`
	Node   string `json:"node"`
	Pool   string `json:"pool"`
	Blocks int    `json:"blocks"`
	// Imported counts the addresses imported; Held those whose imported
	// record kvipam still holds (the rest went with their pods' DELs).
	Imported  int  `json:"imported"`
	Held      int  `json:"held"`
	Borrowed  int  `json:"borrowed"`
	Finalized bool `json:"finalized"`
}

// importStatusOut is import status's answer.
type importStatusOut struct {
	Imports   []importLine                `json:"imports"`
	Finalized []etcdstore.ImportFinalized `json:"finalized,omitempty"`
}

func (a *app) importStatus(ctx context.Context) error {
	cli, err := a.client(ctx)
	if err != nil {
		return err
	}
	s := etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1})
	marks, err := s.ListImportMarks(ctx)
	if err != nil {
		return err
	}
	var out importStatusOut
	if out.Finalized, err = s.ListImportsFinalized(ctx); err != nil {
		return err
	}
	lines := map[[3]string]*importLine{}
	var order [][3]string
	for _, m := range marks {
		k := [3]string{m.Source, m.Node, m.Pool}
		l := lines[k]
		if l == nil {
			l = &importLine{Source: m.Source, Node: m.Node, Pool: m.Pool}
			lines[k] = l
			order = append(order, k)
		}
		l.Blocks++
		l.Imported += len(m.Addrs)
		refs := make([]records.IPRef, len(m.Addrs))
		for i, ad := range m.Addrs {
			refs[i] = records.IPRef{Pool: m.Pool, Block: m.Block, Addr: ad}
		}
		got, err := s.GetIPs(ctx, refs)
		if err != nil {
			return err
		}
		for _, al := range got {
			if al.Imported == m.Source && al.Node == m.Node {
				l.Held++
				if al.Borrowed {
					l.Borrowed++
				}
			}
		}
	}
	for _, k := range order {
		out.Imports = append(out.Imports, *lines[k])
	}
	for _, f := range out.Finalized {
		if !slices.ContainsFunc(out.Imports, func(l importLine) bool { return l.Source == f.Source }) {
			out.Imports = append(out.Imports, importLine{Source: f.Source, Imported: f.Addrs, Finalized: true})
		}
	}
	return a.render(a.stdout, out, func(tw io.Writer) {
		row(tw, "SOURCE", "NODE", "POOL", "BLOCKS", "IMPORTED", "HELD", "BORROWED", "FINALIZED")
		for _, l := range out.Imports {
			row(tw, l.Source, l.Node, l.Pool, l.Blocks, l.Imported, l.Held, l.Borrowed, l.Finalized)
		}
	})
}

// finalizeOut is import finalize's answer.
type finalizeOut struct {
	Source  string   `json:"source"`
	Marks   int      `json:"marks"`
	Addrs   int      `json:"addrs"`
	Removed []string `json:"removedFiles,omitempty"`
}

// importFinalize drops source's marks and, with dir (host-local),
// removes the source's files of the addresses they listed.
func (a *app) importFinalize(ctx context.Context, source, dir string) error {
	if dir != "" && !strings.HasPrefix(source, "host-local:") {
		return fmt.Errorf("import finalize %s: --dir is for a host-local source", source)
	}
	cli, err := a.client(ctx)
	if err != nil {
		return err
	}
	s := etcdstore.New(cli, etcdstore.Options{HistoryRetention: -1, CallTimeout: -1})
	dropped, err := s.FinalizeImport(ctx, source)
	if err != nil {
		return err
	}
	out := finalizeOut{Source: source, Marks: len(dropped)}
	for _, m := range dropped {
		out.Addrs += len(m.Addrs)
		if dir == "" {
			continue
		}
		for _, ad := range m.Addrs {
			if err := removeSourceFile(dir, ad); err != nil {
				return err
			}
			out.Removed = append(out.Removed, ad.String())
		}
	}
	fmt.Fprintf(a.stderr, "kvipamctl: import %s finalized: %d marks, %d addresses\n", source, out.Marks, out.Addrs)
	return a.render(a.stdout, out, func(tw io.Writer) {
		row(tw, "SOURCE", "MARKS", "ADDRS", "FILES REMOVED")
		row(tw, out.Source, out.Marks, out.Addrs, len(out.Removed))
	})
}

// removeSourceFile removes host-local's file of addr from dir; one gone
// already is fine.
func removeSourceFile(dir string, addr netip.Addr) error {
	if _, err := hostlocal.ParseOwnerFile(filepath.Join(dir, addr.String())); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("import finalize: %w", err)
	}
	if err := os.Remove(filepath.Join(dir, addr.String())); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("import finalize: %w", err)
	}
	return nil
}
