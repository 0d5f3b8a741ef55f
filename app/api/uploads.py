"""Read a document from a request: JSON `{text, title?, source?, kv?}` or a multipart file
upload (fields `file`, `title?`, `kv?`, each once, no others); `kv` ("eager" or "lazy") comes
back beside it. The `file` part may also be a plain text field (curl's `-F file=<doc.txt`).

Refuses, before anything is written: bodies over the size limit (413), other content types
(415), malformed or too deeply nested JSON (400), schema violations (422), non-UTF-8, empty or
unencodable text (422, `retrieval.text`: a lone surrogate, NUL), titles over `TITLE_MAX_CHARS`
or file names over `FILENAME_MAX_CHARS` (422: the catalog's columns are bounded). A title
taken from the text's first heading is cut to fit.
"""

from __future__ import annotations

import json
from typing import NamedTuple, get_args

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from app.schemas.documents import FILENAME_MAX_CHARS, TITLE_MAX_CHARS, DocumentIn, KvMode
from retrieval.sources import SourceDocument, title_of
from retrieval.text import text_problem

# JSON escaping can inflate text; the raw body may exceed the text limit by this much.
JSON_OVERHEAD = 64 * 1024
TEXT_TYPES = ("text/plain", "text/markdown", "text/x-markdown", "application/octet-stream", "")
TEXT_SUFFIXES = (".txt", ".md", ".markdown")
FORM_FIELDS = ("file", "title", "kv")


class Upload(NamedTuple):
    """A document to ingest and the KV mode asked for with it (None: the server's default)."""

    doc: SourceDocument
    kv: str | None = None


async def read_document(request: Request, limit: int) -> Upload:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + JSON_OVERHEAD:
        raise _too_large(limit)
    if kind == "application/json":
        return _from_json(await _read_body(request, limit + JSON_OVERHEAD), limit)
    if kind == "multipart/form-data":
        if not declared:  # file parts spool without a cap; the declared length is the cap
            raise HTTPException(411, "file uploads need a Content-Length header")
        return await _from_form(request, limit)
    raise HTTPException(
        415, "send application/json {text, title?} or multipart/form-data with a file"
    )


async def _read_body(request: Request, cap: int) -> bytes:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > cap:
            raise _too_large(cap - JSON_OVERHEAD)
    return bytes(body)


def _from_json(raw: bytes, limit: int) -> Upload:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPException(400, "the request body is not valid JSON") from None
    except RecursionError:  # e.g. [[[[...]]]] 100,000 deep: refuse it like /ask does
        raise HTTPException(400, "the request body is not valid JSON (nested too deeply)") from None
    try:
        doc = DocumentIn.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None
    return Upload(_document(doc.text, doc.title, doc.source or "api", limit), doc.kv)


async def _from_form(request: Request, limit: int) -> Upload:
    form = await request.form(max_files=1, max_fields=4, max_part_size=limit + 1)
    unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
    if unknown:
        raise HTTPException(
            422, f"unknown form field {unknown[0]!r}; the fields are {', '.join(FORM_FIELDS)}"
        )
    if any(len(form.getlist(field)) > 1 for field in FORM_FIELDS):
        raise HTTPException(422, "each form field may be sent once")
    kv = form.get("kv")
    if kv is not None and (not isinstance(kv, str) or kv not in get_args(KvMode)):
        raise HTTPException(422, f"kv must be one of {', '.join(get_args(KvMode))}")
    name, text = await _file_text(form.get("file"), limit)
    title = form.get("title")
    if isinstance(title, str) and len(title) > TITLE_MAX_CHARS:
        raise HTTPException(
            422, f"title: the title has {len(title)} characters; the limit is {TITLE_MAX_CHARS}"
        )
    return Upload(
        _document(
            text,
            title if isinstance(title, str) else None,
            f"upload:{name}",
            limit,
            fallback_title=name.rsplit(".", 1)[0],
        ),
        kv,
    )


async def _file_text(upload: UploadFile | str | None, limit: int) -> tuple[str, str]:
    """(file name, text) of the `file` part: a .txt / .md file part, or a plain text field
    (no file name, as curl's `-F file=<doc.txt` sends it; named `upload.txt`)."""
    if upload is None:
        raise HTTPException(422, "the form has no 'file' part")
    if isinstance(upload, str):
        return "upload.txt", upload
    name = upload.filename or "upload.txt"
    if len(name) > FILENAME_MAX_CHARS:
        raise HTTPException(
            422, f"the file name has {len(name)} characters; the limit is {FILENAME_MAX_CHARS}"
        )
    if (
        not name.lower().endswith(TEXT_SUFFIXES)
        and (upload.content_type or "") not in TEXT_TYPES[:3]
    ):
        raise HTTPException(415, f"{name}: only UTF-8 .txt and .md files are accepted")
    raw = await upload.read(limit + 1)
    if len(raw) > limit:
        raise _too_large(limit)
    try:
        return name, raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(
            422, f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None


def _document(
    text: str, title: str | None, source: str, limit: int, fallback_title: str = "untitled"
) -> SourceDocument:
    if len(text.encode("utf-8")) > limit:
        raise _too_large(limit)
    if not text.strip():
        raise HTTPException(422, "the document is empty")
    for field, value in (("text", text), ("title", title or ""), ("source", source)):
        problem = text_problem(value)
        if problem is not None:
            raise HTTPException(422, f"{field}: {problem}")
    title = (title or "").strip() or title_of(text, fallback_title)[:TITLE_MAX_CHARS]
    return SourceDocument(source=source, title=title, text=text)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the document is larger than the limit of {limit} bytes")
