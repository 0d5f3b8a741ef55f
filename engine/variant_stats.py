"""What the catalog keeps of a variant's Cache-Craft statistics.

The engine measures them (`app/variants/build.py`) and the variant policy reads them;
the catalog (`app/catalog`) only stores and returns them, so the type lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv import ChunkId


@dataclass(frozen=True)
class VariantStats:
    """Cache-Craft statistics of a variant (see DESIGN.md); every field optional."""

    a: float | None = None
    b: float | None = None
    cci: float | None = None
    inter_scores: dict[ChunkId, float] | None = None
    token_scores: list[float] | None = None
    expected_savings: float | None = None
