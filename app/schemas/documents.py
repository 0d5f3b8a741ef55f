"""`/documents`: add text (JSON or file upload), list, show and delete documents."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.common import Text

# The catalog's title and source columns hold 1024 characters; "upload:" + a file name must fit.
TITLE_MAX_CHARS = 1000
FILENAME_MAX_CHARS = 255


KvMode = Literal["eager", "lazy"]
KV_HELP = (
    "eager: compute every chunk's base KV now; lazy: only index it, the first request that "
    "retrieves a "
    "chunk computes its KV (default: the KVMOSAIC_INGEST_KV setting)"
)


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: Text = Field(min_length=1, description="UTF-8 text or markdown; size limit is a setting")
    title: Text | None = Field(
        default=None, max_length=TITLE_MAX_CHARS, description="default: first heading"
    )
    source: Text | None = Field(
        default=None, max_length=TITLE_MAX_CHARS, description="where it came from"
    )
    kv: KvMode | None = Field(default=None, description=KV_HELP)


class DocumentOut(BaseModel):
    id: int
    title: str
    source: str
    content_hash: str
    num_chunks: int
    created_at: datetime


class IngestOut(BaseModel):
    document: DocumentOut
    created: bool = Field(description="false: the same content was already ingested")
    num_tokens: int
    seconds: float
    kv: KvMode = Field(
        default="eager", description="lazy: no base KV was computed (kv_tiers is empty)"
    )
    kv_tiers: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "chunks whose base KV each store tier took ('none': no tier could; computed on first "
            "use); "
            "a memory tier (cpu, gpu) here means every persistent tier was down or could not write"
        ),
    )
    kv_memory_only: int = Field(
        default=0,
        description=(
            "chunks whose base KV no persistent tier could take (a full disk: see /readyz): held "
            "in memory, "
            "copied to the persistent tier once it can write, recomputed on first use after a "
            "restart"
        ),
    )
    kv_conditioned: int = Field(
        default=0,
        description="chunks whose neighbour-conditioned base was stored "
        "(KVMOSAIC_CONDITIONED_NEIGHBOURS; 0 where it is off or the ingest was lazy)",
    )
    warning: str | None = Field(default=None, description="set when kv_memory_only > 0, in words")


class DocumentList(BaseModel):
    documents: list[DocumentOut]
    total: int
    offset: int
    limit: int


class ChunkBrief(BaseModel):
    id: int
    ordinal: int
    num_tokens: int
    text: str


class DocumentDetail(DocumentOut):
    chunks: list[ChunkBrief]
