"""kvmosaic retrieval: split documents into token-sized chunks, embed them, search them.

Knows nothing about the LLM, the KV store or HTTP: the chunker counts tokens with whatever
callable it is given, the embedder is MiniLM (offline), and the index maps integer chunk ids
to normalised embeddings. `app/` wires these to the catalog and the engine.
"""

from retrieval.chunker import Chunker, TextChunk
from retrieval.index import Hit, VectorIndex
from retrieval.retriever import Retriever
from retrieval.sources import SourceDocument, load_sources

__all__ = [
    "Chunker",
    "Hit",
    "Retriever",
    "SourceDocument",
    "TextChunk",
    "VectorIndex",
    "load_sources",
]
