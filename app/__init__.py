"""kvmosaic application layer: settings, HTTP API, web demo, the command line, and the request
path's stages around the engine: the catalog (`catalog/`), the KV store (`store/`) and the chunk
KV cache that joins them to the engine (`kvcache/`). See app/README.md."""
