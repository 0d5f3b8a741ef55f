"""Chunk KV between the catalog, the store and the engine: the request path's load and store steps.

- `chunk_cache.py` — `ServiceChunkCache`, what the service and `/admin` use (`open_chunk_cache`).
- `cache.py` — `ChunkKVCache`: a request's chunks read from the store (pinned, layer by layer),
  missing base KV computed and stored, variants chosen and kept through the mode's policy.
- `builder.py` — `VariantBuilder`, Cache-Craft's exact variants built in the background.
- `reconcile.py` — `Reconciler`, the catalog and the store brought to agree.

The engine knows nothing of this package; the store (`app/store`) and the catalog
(`app/catalog`) know nothing of each other. This is where the three meet.
"""
