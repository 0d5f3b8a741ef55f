"""Rows that decode with other weights: `full[decode_weights=int8]` decodes `full`'s own prefill
(a copy of its cache, taken before `full` decoded) with a native step of those weights
(engine/model/decode_weights.py), so the row's figures against `full` are the weights' alone.

One engine serves every row, so a row's decode weights are swapped in for its decode only
(`decoding_with`); rows run one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.config import DECODE_WEIGHTS
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.model.native_step import NativeDecodeStep

KEY = "decode_weights"

_steps: dict[tuple[int, str], NativeDecodeStep] = {}  # built once per engine and weights


def checked_weights(label: str, weights: str | None) -> str | None:
    """`weights` if they name a format the native step decodes with (`auto` is the engine's
    own choice, not a format); InvalidRequest naming the row otherwise."""
    if weights is None:
        return None
    formats = tuple(w for w in DECODE_WEIGHTS if w != "auto")
    if weights not in formats:
        raise InvalidRequest(f"row {label!r}: decode_weights is one of {', '.join(formats)}")
    return weights


@contextmanager
def decoding_with(engine: Engine, weights: str | None) -> Iterator[None]:
    """Decode with a native step of `weights` inside the block (None: the engine's own)."""
    if weights is None:
        yield
        return
    stack = engine.stack
    if stack.native is None:
        raise InvalidRequest(
            f"decode weights {weights!r} need the native decode step, which cannot run here: "
            f"{stack.native_unfit}"
        )
    key = (id(stack), weights)
    if key not in _steps:
        _steps[key] = engine.compute(lambda: NativeDecodeStep(stack, weights))
    own, stack.native = stack.native, _steps[key]
    try:
        yield
    finally:
        stack.native = own
