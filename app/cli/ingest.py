"""`kvmosaic ingest PATH...`: add text / markdown files, directories or benchmark JSON.

Each document is all or nothing; a document that fails is reported and the others go on.
Run it while the server is stopped (a running server reads the index only at start-up), or
add documents through `POST /documents` instead.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from app.cli.common import add_settings_arguments, settings_from


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ingest", help="add documents: chunk, embed, index, precompute KV")
    add_settings_arguments(parser)
    parser.add_argument("paths", nargs="+", type=Path, help=".txt / .md files, directories, benchmark .json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from tqdm import tqdm

    from app.services import Services
    from engine.errors import KvMosaicError
    from retrieval.sources import SourceError, load_sources

    started = time.perf_counter()
    try:
        docs = list(load_sources(args.paths))  # every path is read before anything is written
    except SourceError as exc:
        print(f"kvmosaic: error: {exc}", file=sys.stderr)
        return 2
    services = Services.start(settings_from(args))
    added = present = chunks = tokens = failed = 0
    try:
        with tqdm(total=len(docs), unit="doc", disable=args.quiet, file=sys.stderr) as bar:
            for doc in docs:
                bar.set_postfix_str(doc.title[:30])
                try:
                    result = services.ingestor.ingest(doc)
                except (KvMosaicError, SourceError, ValueError) as exc:
                    failed += 1
                    tqdm.write(f"kvmosaic: {doc.source}: not ingested: {exc}", file=sys.stderr)
                else:
                    added, present = added + result.created, present + (not result.created)
                    chunks += result.document.num_chunks if result.created else 0
                    tokens += result.num_tokens
                bar.update(1)
    finally:
        services.close()
    print(f"ingested {added} new documents ({chunks} chunks, {tokens} tokens) in "
          f"{time.perf_counter() - started:.1f} s; {present} already present; {failed} failed")
    return 1 if failed else 0
