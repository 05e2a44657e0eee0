//go:build tools

// Package tools pins containerd for the real node (`gpualloc dev up --real-node`):
// the daemon, its runc shim and ctr. go.sum makes the build reproducible.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
