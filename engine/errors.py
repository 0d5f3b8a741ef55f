"""Exceptions the engine raises for bad input or refused work.

Every error a caller can cause is an `InvalidRequest` (a `ValueError`), so a web layer can
map the whole family to a 4xx answer; anything else escaping the engine is a bug.
"""


class KvMosaicError(Exception):
    """Base of every error raised on purpose by kvmosaic."""


class UnsupportedModel(KvMosaicError):
    """The model cannot be served exactly (its type, attention window or RoPE); raised at load."""


class InvalidRequest(KvMosaicError, ValueError):
    """The request itself is wrong (empty question, no chunks, ratio outside [0, 1], ...)."""


class PromptTooLong(InvalidRequest):
    """The assembled prompt (plus the tokens to generate) exceeds the model's context."""


class UnknownMode(InvalidRequest):
    """No planner is registered under the requested mode name."""


class EngineClosed(KvMosaicError):
    """The engine is shutting down and takes no more decoding work."""
