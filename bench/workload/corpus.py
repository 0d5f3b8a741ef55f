"""The benchmark's corpus, ingested once through the real ingest path into a reusable snapshot.

A corpus is a directory of `.txt` / `.md` files or a benchmark JSON (`[{question, answers,
ctxs}]`): from a JSON, every distinct passage of the chosen records becomes a document and
the records' questions are what a generated trace asks. The snapshot is a data dir (SQLite
catalog, vector index, base KV on disk) kept under the work dir and named by what decides its
content, so a later run with the same corpus, model and chunking starts from it again; every
run of a mode starts from a copy of it (`clone_snapshot`), with base KV only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from engine.errors import InvalidRequest
from retrieval.sources import SourceDocument, SourceError, load_sources

log = logging.getLogger(__name__)

READY = "snapshot.json"
SNAPSHOT_FIELDS = (
    "chunk_tokens",
    "chunk_overlap",
    "store_tiers",
    "store_codec",
    "store_dtype",
    "ingest_kv",
    "encode_dtype",
)


@dataclass(frozen=True)
class Corpus:
    """Documents to ingest and the questions a generated trace may ask (empty for a directory)."""

    name: str
    documents: tuple[SourceDocument, ...]
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...] = ()  # gold answers per question (empty: none known)


@dataclass(frozen=True)
class Snapshot:
    """An ingested data dir and what it cost to build (`reused`: built by an earlier run)."""

    path: Path
    documents: int
    chunks: int
    tokens: int
    kv_bytes: int
    ingest_seconds: float
    reused: bool


def load_corpus(path: Path, start: int = 0, records: int | None = None) -> Corpus:
    """The corpus at `path`; for a benchmark JSON, records [start, start + records) only."""
    if not path.exists():
        raise InvalidRequest(f"{path}: no such corpus")
    if path.suffix.lower() != ".json":
        try:
            return Corpus(path.name, tuple(load_sources([path])), ())
        except SourceError as exc:
            raise InvalidRequest(str(exc)) from None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path}: not a benchmark JSON ({exc})") from None
    if not isinstance(data, list):
        raise InvalidRequest(f"{path}: expected a list of {{question, answers, ctxs}} records")
    chosen = data[start : None if records is None else start + records]
    if not chosen:
        raise InvalidRequest(f"{path}: no records in [{start}, {start + (records or 0)})")
    asked = [r for r in chosen if isinstance(r, dict) and r.get("question")]
    return Corpus(
        f"{path.name}[{start}:{start + len(chosen)}]",
        tuple(_pooled_passages(path, chosen, start)),
        tuple(r["question"].strip() for r in asked),
        tuple(_gold(r) for r in asked),
    )


def _gold(record: dict) -> tuple[str, ...]:
    """A record's gold answers (`answers`, a list of strings; anything else: none)."""
    answers = record.get("answers")
    return tuple(a for a in answers if isinstance(a, str)) if isinstance(answers, list) else ()


def _pooled_passages(path: Path, records: list, start: int) -> list[SourceDocument]:
    """Every distinct passage (by text) of the records, in order of first appearance."""
    seen: dict[str, SourceDocument] = {}
    for r, record in enumerate(records, start=start):
        for c, ctx in enumerate(record.get("ctxs", []) if isinstance(record, dict) else []):
            text = (ctx.get("text") or "").strip()
            if text and text not in seen:
                seen[text] = SourceDocument(
                    f"{path.name}#{r}.{c}", (ctx.get("title") or "").strip(), text
                )
    return list(seen.values())


def snapshot_key(corpus: Corpus, settings, fingerprint: str) -> str:
    """What decides a snapshot's content: documents, model, chunking, the store's format and
    tiers."""
    digest = hashlib.sha256()
    for doc in corpus.documents:
        digest.update(hashlib.sha256(f"{doc.title}\n{doc.text}".encode()).digest())
    # chunking, the KV format, the tiers and eager or lazy KV decide the content; capacities, paths
    # and policies do not
    decisive = {k: v for k, v in settings.model_dump().items() if k in SNAPSHOT_FIELDS}
    digest.update(repr((fingerprint, sorted(decisive.items()))).encode())
    return digest.hexdigest()[:16]


def build_snapshot(
    corpus: Corpus, directory: Path, start_services: Callable, progress: bool = True
) -> Snapshot:
    """Ingest the corpus into `directory` (or reuse it when a finished snapshot is there).

    `start_services(data_dir)` opens the server's services on a data dir. An unfinished
    directory (no snapshot.json: a run stopped mid-ingest) is ingested into again; ingest is
    idempotent per document, so nothing is computed twice.
    """
    ready = directory / READY
    if ready.exists():
        return Snapshot(**{**json.loads(ready.read_text()), "path": directory, "reused": True})
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    services = start_services(directory)
    try:
        tokens = _ingest_all(services, corpus, progress)
        chunks = sum(d.num_chunks for d in _documents(services.catalog))
    finally:
        services.close()
    snapshot = Snapshot(
        directory,
        len(corpus.documents),
        chunks,
        tokens,
        _kv_bytes(directory),
        time.perf_counter() - started,
        False,
    )
    ready.write_text(
        json.dumps({k: v for k, v in asdict(snapshot).items() if k not in ("path", "reused")})
    )
    return snapshot


def _ingest_all(services, corpus: Corpus, progress: bool) -> int:
    tokens = 0
    with tqdm(total=len(corpus.documents), unit="doc", desc="ingest", disable=not progress) as bar:
        for doc in corpus.documents:
            tokens += services.ingestor.ingest(doc).num_tokens
            bar.set_postfix(tokens=tokens)
            bar.update(1)
    return tokens


def _documents(catalog):
    from app.ingest import iter_documents

    return iter_documents(catalog)


def _kv_bytes(directory: Path) -> int:
    return (
        sum(p.stat().st_size for p in (directory / "kv").rglob("*") if p.is_file())
        if (directory / "kv").exists()
        else 0
    )


def clone_snapshot(snapshot: Path, destination: Path) -> Path:
    """A private copy of the snapshot for one run: KV files hard-linked (the disk tier never
    writes a file in place, it renames a new one over it), everything else copied."""
    if destination.exists():
        shutil.rmtree(destination)

    def link_or_copy(src: str, dst: str) -> str:
        try:
            os.link(src, dst)
            return dst
        except OSError:  # another file system, or links not allowed
            return shutil.copy2(src, dst)

    shutil.copytree(
        snapshot,
        destination,
        ignore=lambda where, names: [
            n for n in names if n in (READY, "kv") and Path(where) == snapshot
        ],
    )
    if (snapshot / "kv").exists():  # linked, so a clone costs no KV bytes
        shutil.copytree(snapshot / "kv", destination / "kv", copy_function=link_or_copy)
    return destination
