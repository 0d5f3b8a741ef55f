"""Field types shared by the request schemas: integers the catalog and torch can hold, and text
the tokenizer and the embedder can encode.

Every integer a client sends ends up somewhere with a fixed width: catalog ids and offsets
in 64-bit database columns (SQLite raises OverflowError, PostgreSQL "integer out of range"),
seeds in torch's 64-bit generator. Bounding them here turns an out-of-range value into a 422
instead of a 500 deep in the database driver. Body integers, numbers and booleans are strict,
so `true` is not an id or a temperature and `0` is not a boolean (an integral `3.0` is an
integer, as in JSON Schema; `1` is a number). Every text field that reaches the tokenizer, the
embedder or the catalog is `Text`: `retrieval.text.text_problem` refuses a lone surrogate or a
NUL there, the same check the service runs on text that comes by other ways (a form, the CLI).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, Strict

from retrieval.text import text_problem

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# The upper bound as an exclusive one: 2**63 is exact as a float, INT64_MAX is not, and the
# OpenAPI document writes bounds as floats (FastAPI's schema model), so `le=INT64_MAX` would
# publish 2**63 as allowed.
INT64_END = 1 << 63


def _whole_float_to_int(value: object) -> object:
    """JSON Schema counts 16.0 as an integer; a bool or a string is not one (left to fail)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers as JSON Schema means them, within the bounds of their `Field`: 3 and 3.0 yes; true,
# "3", 3.5 no (422). The bounds go before the float conversion so they reach the JSON schema
# as minimum / maximum (after a validator pydantic cannot translate them).
WHOLE_FLOAT = BeforeValidator(_whole_float_to_int)
TopK = Annotated[int, Strict(), Field(ge=1, le=20), WHOLE_FLOAT]
# An answer's token budget; its upper limit is a setting (`max_tokens_limit`).
TokenBudget = Annotated[int, Strict(), Field(ge=1), WHOLE_FLOAT]
# A catalog row id in a JSON body (ids start at 1).
RowId = Annotated[int, Strict(), Field(ge=1, lt=INT64_END), WHOLE_FLOAT]
# A sampling seed: any signed 64-bit integer (what torch.Generator.manual_seed takes).
Seed = Annotated[int, Strict(), Field(ge=INT64_MIN, lt=INT64_END), WHOLE_FLOAT]
# A byte count.
ByteCount = Annotated[int, Strict(), Field(ge=1, lt=INT64_END), WHOLE_FLOAT]

# Sampling and recompute knobs of /ask and chat: JSON Schema numbers within the bounds of their
# `Field`: 1 and 0.5 yes; true, false, "0.5" no (422).
Ratio = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]
Temperature = Annotated[float, Strict(), Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Strict(), Field(le=1.0, gt=0.0)]


def _encodable(value: object) -> object:
    """A str the tokenizer cannot encode fails here, naming the character (pydantic's own str
    check refuses a lone surrogate too, but without saying which or where)."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value


# Text a request sends for the tokenizer, the embedder or the catalog (a 422 naming the
# character otherwise).
Text = Annotated[str, BeforeValidator(_encodable)]
