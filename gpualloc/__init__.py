"""gpualloc: topology-aware GPU allocation for Kubernetes."""
