//go:build tools

// Package tools pins toxiproxy, the TCP proxy that puts latency, jitter and cut
// connections between the controllers and the API server in the race test
// (tests/integration/test_race_crash.py). go.sum makes the build reproducible.
package tools

import (
	_ "github.com/Shopify/toxiproxy/v2/cmd/server"
)
