"""Chunk variants across modes: the one policy that chooses, keeps and values them (`policy`),
the recent traffic that says where building them repays (`traffic`), and which rows of a
finished request are exact in their context (`harvest`).

The mode's planner class says what it may use (`variant_use`) and leave (`leaves`); the
service (`engine/chunk_cache.py`) and the benchmarks (`engine/cachecraft/book.py`) go through
`VariantPolicy`, so a benchmark measures the policy the server runs.
"""

from engine.variants.policy import VariantPolicy, blend_cost

__all__ = ["VariantPolicy", "blend_cost"]
