//go:build tools

// Package tools pins vegeta, the HTTP load generator of the webhook benchmark
// (bench/webhook_vegeta.py). go.sum makes the build reproducible.
package tools

import (
	_ "github.com/tsenart/vegeta/v12"
)
