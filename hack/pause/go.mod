// The pause program of the real node's pod sandboxes (gpualloc's own; no registry
// image is pulled). Standard library only.
module gpualloc.dev/hack/pause

go 1.26.0
