//go:build tools

// Package tools pins helm, which installs gpualloc's chart in the end-to-end
// tests. go.sum makes the build reproducible.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
