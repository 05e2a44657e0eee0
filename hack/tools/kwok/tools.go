//go:build tools

// Package tools pins kwok, which simulates fake nodes (and the pods bound to
// them) for gpualloc's local control plane. go.sum makes the build reproducible.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
