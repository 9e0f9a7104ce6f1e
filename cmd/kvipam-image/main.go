// Command kvipam-image builds kvipam's container image as an OCI image
// archive (an OCI layout in a tar file), with no daemon and no registry:
// static binaries (kvipam-agent, kvipam, kvipam-ipam, kvipamctl and the
// reference loopback plugin, which containerd's CRI needs) and the default
// conflist on an empty base, no shell. It is reproducible: file times,
// owners and order are fixed and the binaries are built with -trimpath and
// no build ID, so the same commit gives the same digest. `make image`
// runs it.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	var o options
	flag.StringVar(&o.out, "out", "bin/kvipam-image.tar", "the OCI archive to write")
	flag.StringVar(&o.ref, "ref", "ghcr.io/kvipam/kvipam:dev", "the image reference recorded in the archive")
	flag.StringVar(&o.conflist, "conflist", "deploy/cni/10-kvipam.conflist", "the conflist the image carries at /etc/kvipam/10-kvipam.conflist")
	flag.StringVar(&o.ldflags, "ldflags", "", "extra -ldflags for the binaries (make image passes the version and commit, as make build does)")
	flag.Parse()
	digest, err := build(o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvipam-image: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s %s %s\n", o.out, o.ref, digest)
}
