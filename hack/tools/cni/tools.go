//go:build tools

// Package tools pins the CNI plugins the real node's containerd uses (bridge,
// host-local, loopback). go.sum makes the build reproducible.
package tools

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
)
