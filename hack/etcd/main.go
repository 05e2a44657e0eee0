// Command etcd is the etcd server, built from its Go module for the local
// control plane that gpualloc's tests, demo and benchmarks run against.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
