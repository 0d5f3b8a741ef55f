"""Chunk variants across modes: the one policy that chooses, keeps and values them (`policy`),
the recent traffic that says where building them repays (`traffic`), which rows of a
finished request are exact in their context (`harvest`), exact variants built from a finished
request (`build`) and an in-memory variant book for benchmarks and tests (`book`). The
statistics a variant carries are `engine/variant_stats.py`, below the plan and the catalog.

The mode's planner class says what it may use (`variant_use`) and leave (`leaves`); the
service (`app/kvcache/cache.py`) and the benchmarks (`app/variants/book.py`) go through
`VariantPolicy`, so a benchmark measures the policy the server runs.
"""

from app.variants.policy import VariantPolicy, blend_cost

__all__ = ["VariantPolicy", "blend_cost"]
