"""Field types shared by the request schemas: integers the catalog and torch can hold.

Every integer a client sends ends up somewhere with a fixed width: catalog ids and offsets
in 64-bit database columns (SQLite raises OverflowError, PostgreSQL "integer out of range"),
seeds in torch's 64-bit generator. Bounding them here turns an out-of-range value into a 422
instead of a 500 deep in the database driver. Body integers, numbers and booleans are strict,
so `true` is not an id or a temperature and `0` is not a boolean (an integral `3.0` is an
integer, as in JSON Schema; `1` is a number).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, Strict

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# The upper bound as an exclusive one: 2**63 is exact as a float, INT64_MAX is not, and the
# OpenAPI document writes bounds as floats (FastAPI's schema model), so `le=INT64_MAX` would
# publish 2**63 as allowed.
INT64_END = 1 << 63


def _whole_float_to_int(value):
    """JSON Schema counts 16.0 as an integer; a bool or a string is not one (left to fail)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(ge: int | None = None, le: int | None = None, lt: int | None = None):
    """An integer as JSON Schema means it, within the bounds: 3 and 3.0 yes; true, "3", 3.5 no
    (422).

    The bounds go before the float conversion so they reach the JSON schema as
    minimum / maximum (after a validator pydantic cannot translate them).
    """
    return Annotated[
        int, Strict(), Field(ge=ge, le=le, lt=lt), BeforeValidator(_whole_float_to_int)
    ]


def json_number(ge: float | None = None, le: float | None = None, gt: float | None = None):
    """A JSON Schema number within the bounds: 1 and 0.5 yes; true, false, "0.5" no (422)."""
    return Annotated[float, Strict(), Field(ge=ge, le=le, gt=gt)]


TopK = json_int(1, 20)
TokenBudget = json_int(1)  # its upper limit is a setting (`max_tokens_limit`)
# A catalog row id in a JSON body (ids start at 1).
RowId = json_int(1, lt=INT64_END)
# A sampling seed: any signed 64-bit integer (what torch.Generator.manual_seed takes).
Seed = json_int(INT64_MIN, lt=INT64_END)
# A byte count.
ByteCount = json_int(1, lt=INT64_END)
# Sampling and recompute knobs of /ask and chat.
Ratio = json_number(0.0, 1.0)
Temperature = json_number(0.0, 2.0)
TopP = json_number(le=1.0, gt=0.0)
