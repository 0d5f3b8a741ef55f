"""Field types shared by the request schemas: integers the catalog and torch can hold.

Every integer a client sends ends up somewhere with a fixed width: catalog ids and offsets
in 64-bit database columns (SQLite raises OverflowError, PostgreSQL "integer out of range"),
seeds in torch's 64-bit generator. Bounding them here turns an out-of-range value into a 422
instead of a 500 deep in the database driver. Body integers and booleans are strict, so
`true` is not an id and `0` is not a boolean.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# A catalog row id in a JSON body (ids start at 1).
RowId = Annotated[int, Field(ge=1, le=INT64_MAX, strict=True)]
# A sampling seed: any signed 64-bit integer (what torch.Generator.manual_seed takes).
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX, strict=True,
                            description="sampling seed, a signed 64-bit integer")]
