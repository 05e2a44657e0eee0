// The Go baseline of bench/webhook_vegeta.py: a plain net/http webhook, standard library only.
module gpualloc.dev/bench/gowebhook

go 1.26.0
