"""Cache-Craft (arXiv 2502.15734): variant statistics, per-chunk fix budget, variant choice.

- `scores`: the pure formulas (CCI, β, γ, β′, CFO, token choice);
- `stats`: attention statistics of a chunk computed in some context (`ChunkStats`);
- `choice`: the variant cheapest to fix for a request's context (CFO against the blend fix);
- `variants`: exact variants built from a finished request;
- `book`: an in-memory variant book (benchmarks, tests); the service keeps variants in the
  store and the catalog instead (`engine/chunk_cache.py`). Both go through the one policy,
  `engine.variants.VariantPolicy`.
"""
