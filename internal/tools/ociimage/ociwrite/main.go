// Command ociwrite writes an OCI image archive of a few files on an empty
// base, with internal/tools/ociimage (the writer `make image` uses), for
// tests that build images in another module (e2e/k8s) and import them with
// ctr: no registry is reachable.
//
//	ociwrite --out img.tar --ref kvipam.test/x:1 --entrypoint /x [DEST=SRC]...
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/kvipam/kvipam/internal/tools/ociimage"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ociwrite:", err)
		os.Exit(1)
	}
}

func run() error {
	out := flag.String("out", "", "the archive to write")
	ref := flag.String("ref", "", "the image's reference")
	entry := flag.String("entrypoint", "", "the entrypoint, comma separated")
	flag.Parse()
	if *out == "" || *ref == "" {
		return fmt.Errorf("--out and --ref are required")
	}
	spec := ociimage.Spec{Ref: *ref}
	if *entry != "" {
		spec.Entrypoint = strings.Split(*entry, ",")
	}
	for _, a := range flag.Args() {
		dest, src, ok := strings.Cut(a, "=")
		if !ok {
			return fmt.Errorf("%q: want DEST=SRC", a)
		}
		fi, err := os.Stat(src)
		if err != nil {
			return fmt.Errorf("read %s: %w", src, err)
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return fmt.Errorf("read %s: %w", src, err)
		}
		spec.Files = append(spec.Files, ociimage.File{Path: strings.TrimPrefix(dest, "/"), Data: data, Mode: int64(fi.Mode().Perm())})
	}
	if _, err := ociimage.Write(spec, *out); err != nil {
		return fmt.Errorf("write %s: %w", *out, err)
	}
	return nil
}
