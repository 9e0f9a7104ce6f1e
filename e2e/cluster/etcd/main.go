// Command etcd is the etcd server at the version in this module's go.mod,
// built by package cluster to run real multi-process clusters in tests.
// It adds nothing to etcd's own entry point.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
