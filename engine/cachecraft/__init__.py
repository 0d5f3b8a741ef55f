"""Cache-Craft (arXiv 2502.15734): variant statistics, per-chunk recompute budget, variant choice.

- `scores`: the pure formulas (CCI, β, γ, β′, CFO, token choice);
- `stats`: attention statistics of a chunk computed in some context (`VariantStats`);
- `choice`: pick the variant of lowest CFO for a request's context;
- `book`: an in-memory variant book (benchmarks, tests); the service keeps variants in the
  store and the catalog instead (`engine/chunk_cache.py`).
"""
