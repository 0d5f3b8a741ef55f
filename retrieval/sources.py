"""Read documents to ingest from paths: text / markdown files, directories, benchmark JSON.

A benchmark JSON file is a list of records `{question, answers, ctxs: [{title, text}]}`
(the CacheBlend / MuSiQue format); every context passage becomes one document. Files must be
UTF-8. Nothing here touches the catalog: the ingest step decides what is new.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown")


@dataclass(frozen=True)
class SourceDocument:
    """A document before chunking: where it came from, a title and its text."""

    source: str
    title: str
    text: str


class SourceError(ValueError):
    """A path that cannot be read as documents (missing, wrong type, not UTF-8, bad JSON)."""


def load_sources(paths: Iterable[str | Path]) -> Iterator[SourceDocument]:
    """Documents from every path, in order; directories are walked recursively (sorted)."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for child in sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES):
                yield read_text_document(child)
        elif path.suffix.lower() == ".json":
            yield from read_dataset(path)
        elif path.suffix.lower() in TEXT_SUFFIXES:
            yield read_text_document(path)
        elif path.exists():
            raise SourceError(f"{path}: not a .txt, .md or .json file, nor a directory")
        else:
            raise SourceError(f"{path}: no such file or directory")


def read_text_document(path: Path) -> SourceDocument:
    text = _read_utf8(path)
    return SourceDocument(source=str(path), title=title_of(text, path.stem), text=text)


def title_of(text: str, fallback: str) -> str:
    """The first markdown heading, else the fallback (a file name), tidied."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip() or fallback
        if line.strip():
            break
    return fallback.replace("_", " ").replace("-", " ").strip() or "untitled"


def read_dataset(path: Path) -> Iterator[SourceDocument]:
    try:
        records = json.loads(_read_utf8(path))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(records, list):
        raise SourceError(f"{path}: expected a list of records with 'ctxs'")
    for r, record in enumerate(records):
        for c, ctx in enumerate(record.get("ctxs", []) if isinstance(record, dict) else []):
            text = (ctx.get("text") or "").strip()
            if text:
                yield SourceDocument(f"{path}#{r}.{c}", (ctx.get("title") or "").strip(), text)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise SourceError(f"{path}: {exc.strerror}") from exc
