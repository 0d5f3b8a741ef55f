"""`/documents`: add (JSON or file upload), list, show, delete.

Adding and deleting are writes: `WriterDep` applies the access rule of `app/api/access.py`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response

from app.api.deps import ServicesDep, WriterDep
from app.api.errors import documented
from app.api.uploads import read_document
from app.catalog import DocumentRecord, DocumentState
from app.schemas.common import INT64_END
from app.schemas.documents import (
    KV_HELP,
    TITLE_MAX_CHARS,
    ChunkBrief,
    DocumentDetail,
    DocumentList,
    DocumentOut,
    IngestOut,
)

router = APIRouter(prefix="/documents", tags=["documents"])

DocumentId = Annotated[int, Path(ge=1, lt=INT64_END, description="a document id")]

# The body is read by hand (JSON or multipart, size-capped while streaming), so FastAPI cannot
# see it: describe both forms here as `app.api.uploads` enforces them; `app.api.openapi` adds
# DocumentIn to the components and the size limit. The file part is UTF-8 text, which only a
# text schema can say (a `binary` one promises that any bytes are accepted); no other fields.
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/DocumentIn"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "additionalProperties": False,
                    "properties": {
                        "file": {
                            "type": "string",
                            "contentMediaType": "text/plain",
                            "description": "the document: UTF-8 text or markdown, a .txt or .md "
                            "file part (or a plain field, as curl's `-F file=<doc.txt` sends it)",
                        },
                        "title": {"type": "string", "maxLength": TITLE_MAX_CHARS},
                        "kv": {"type": "string", "enum": ["eager", "lazy"], "description": KV_HELP},
                    },
                },
                "encoding": {"file": {"contentType": "text/plain, text/markdown"}},
            },
        },
    }
}


@router.post(
    "",
    response_model=IngestOut,
    status_code=201,
    openapi_extra=UPLOAD_BODY,
    dependencies=[WriterDep],
    responses={
        200: {"description": "the same content was already ingested", "model": IngestOut},
        **documented(400, 401, 403, 411, 413, 415, 422, 503, 507),
    },
)
async def add_document(request: Request, response: Response, services: ServicesDep) -> IngestOut:
    """Chunk, embed, index and precompute the KV of one document (idempotent by content)."""
    upload = await read_document(request, services.settings.max_upload_bytes)
    result = await services.queue.run(services.ingestor.ingest, upload.doc, None, upload.kv)
    if not result.created:
        response.status_code = 200
    return IngestOut(
        document=document_out(result.document),
        created=result.created,
        num_tokens=result.num_tokens,
        seconds=round(result.seconds, 3),
        kv=result.kv,
        kv_tiers=result.kv_tiers,
        kv_memory_only=result.kv_memory_only,
        kv_conditioned=result.kv_conditioned,
        warning=memory_only_warning(result.kv_memory_only, services.chunk_cache.persistent_tier),
    )


STATE_HELP = (
    "ready: documents whose ingest finished (retrievable); ingesting: those still being ingested, "
    "or left by a crashed ingest until its lease expires"
)


@router.get("", response_model=DocumentList, responses=documented(422))
def list_documents(
    services: ServicesDep,
    offset: int = Query(0, ge=0, lt=INT64_END),
    limit: int = Query(50, ge=1, le=500),
    state: DocumentState = Query("ready", description=STATE_HELP),  # noqa: B008 (FastAPI)
) -> DocumentList:
    """Documents by id; only finished ones unless `state=ingesting` asks for the others."""
    documents = services.catalog.list_documents(offset=offset, limit=limit, state=state)
    return DocumentList(
        documents=[document_out(d) for d in documents],
        offset=offset,
        limit=limit,
        total=services.catalog.count_documents(state),
    )


@router.get("/{document_id}", response_model=DocumentDetail, responses=documented(404, 422))
def get_document(document_id: DocumentId, services: ServicesDep) -> DocumentDetail:
    """A finished document and its chunks (404 while it is being ingested)."""
    document = services.catalog.get_document(document_id, state="ready")
    if document is None:
        raise HTTPException(404, f"no document {document_id}")
    chunks = [
        ChunkBrief(id=c.id, ordinal=c.ordinal, num_tokens=c.num_tokens, text=c.text)
        for c in services.catalog.chunks_of_document(document_id)
    ]
    return DocumentDetail(**document_out(document).model_dump(), chunks=chunks)


@router.delete(
    "/{document_id}",
    status_code=204,
    dependencies=[WriterDep],
    responses=documented(401, 403, 404, 422, 507),
)
def delete_document(document_id: DocumentId, services: ServicesDep) -> Response:
    """Remove the document, its chunks, their variants, KV and index rows."""
    if not services.ingestor.delete(document_id):
        raise HTTPException(404, f"no document {document_id}")
    return Response(status_code=204)


def memory_only_warning(chunks: int, tier: str | None) -> str | None:
    """What an ingest response says when some base KV found no persistent tier."""
    if not chunks:
        return None
    return (
        f"the base KV of {chunks} chunks is held in memory only: tier {tier} cannot write now (see "
        "/readyz); "
        "it is copied there once it can, and recomputed on first use after a restart"
    )


def document_out(d: DocumentRecord) -> DocumentOut:
    return DocumentOut(
        id=d.id,
        title=d.title,
        source=d.source,
        content_hash=d.content_hash,
        num_chunks=d.num_chunks,
        created_at=d.created_at,
    )
