"""kvmosaic engine: runs a Llama-family model layer by layer and reuses chunk KV at any position.

The engine knows nothing about HTTP, retrieval, the catalog or the KV store; `app/` and
`retrieval/` build on it, never the other way round.
"""

from engine.config import EngineConfig
from engine.errors import (
    InvalidRequest,
    KvMosaicError,
    PromptTooLong,
    UnknownMode,
)

__all__ = [
    "EngineConfig",
    "InvalidRequest",
    "KvMosaicError",
    "PromptTooLong",
    "UnknownMode",
]
