"""Retrieval for one question: FAISS hits → catalog chunks with their documents and token ids.

The index and the catalog can briefly disagree (a document deleted while a request runs):
hits whose chunk is gone are dropped, never served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.catalog import Catalog, ChunkRecord, DocumentRecord
from engine.engine import Engine
from engine.errors import InvalidRequest
from retrieval import Retriever


@dataclass(frozen=True)
class Retrieved:
    """One retrieved chunk, in retrieval order: its row, its document, its prompt token ids."""

    chunk: ChunkRecord
    document: DocumentRecord
    score: float
    token_ids: tuple[int, ...]

    @property
    def chunk_id(self) -> int:
        return self.chunk.id


def retrieve_chunks(
    retriever: Retriever, catalog: Catalog, engine: Engine, question: str, top_k: int
) -> list[Retrieved]:
    """The top_k chunks for the question, best first; InvalidRequest if nothing is ingested."""
    hits = retriever.search(question, top_k)
    if not hits:
        raise InvalidRequest(
            "no documents are ingested yet: add some with POST /documents or `kvmosaic ingest`"
        )
    rows = catalog.get_chunks([h.chunk_id for h in hits])
    documents = documents_of(catalog, [r.document_id for r in rows if r is not None])
    found = [
        (hit, row)
        for hit, row in zip(hits, rows)
        if row is not None and row.document_id in documents
    ]
    if not found:
        raise InvalidRequest("the retrieved chunks were just deleted; ask again")
    return [
        Retrieved(
            row,
            documents[row.document_id],
            hit.score,
            chunk_token_ids(engine, row.text, documents[row.document_id].title),
        )
        for hit, row in found
    ]


def chunk_token_ids(engine: Engine, text: str, title: str) -> tuple[int, ...]:
    """The ids a chunk has in every prompt (and in its cached KV): title, blank line, text.

    The title tells the model what a later chunk of a document is about; a chunk that
    already opens with it (a markdown heading) is not given it twice.
    """
    opens_with_title = bool(title) and text.lstrip("# \t").startswith(title)
    return engine.chunk_ids(text, "" if opens_with_title else title)


def documents_of(catalog: Catalog, ids: Sequence[int]) -> dict[int, DocumentRecord]:
    """The documents of `ids` that exist, by id (each read once)."""
    out: dict[int, DocumentRecord] = {}
    for document_id in dict.fromkeys(ids):
        document = catalog.get_document(document_id)
        if document is not None:
            out[document_id] = document
    return out
