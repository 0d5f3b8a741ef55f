"""`kvmosaic ingest PATH...`: add text / markdown files, directories or benchmark JSON.

Each document is all or nothing; a document that fails is reported and the others go on.
`--kv eager` (default: `KVMOSAIC_INGEST_KV`) computes every chunk's base KV now, in packed
batches; `--kv lazy` only chunks, embeds and indexes (the first request that retrieves a
chunk computes its KV). The progress bar counts documents and shows chunk tokens per second.
A server on the same catalog picks the new documents up from the catalog's change log
within `KVMOSAIC_INDEX_POLL_S`; `POST /documents` does the same through a server.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from app.cli.common import add_settings_arguments, settings_from


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ingest", help="add documents: chunk, embed, index, precompute KV"
    )
    add_settings_arguments(parser)
    parser.add_argument(
        "paths", nargs="+", type=Path, help=".txt / .md files, directories, benchmark .json"
    )
    parser.add_argument(
        "--kv",
        choices=["eager", "lazy"],
        default=None,
        help="base KV now (eager) or on first retrieval (lazy); default KVMOSAIC_INGEST_KV",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from tqdm import tqdm

    from app.startup import start_services
    from engine.errors import KvMosaicError
    from retrieval.sources import SourceError, load_sources

    started = time.perf_counter()
    try:
        docs = list(load_sources(args.paths))  # every path is read before anything is written
    except SourceError as exc:
        print(f"kvmosaic: error: {exc}", file=sys.stderr)
        return 2
    services = start_services(settings_from(args))  # a failed start: one line (StartFailure)
    ingest_started = time.perf_counter()  # the rate leaves out loading the model and the index
    added = present = chunks = tokens = failed = conditioned = 0
    kv_tokens = 0  # chunk tokens whose KV is stored so far, for the live rate

    def progress(num_chunks: int, num_tokens: int) -> None:
        nonlocal kv_tokens
        kv_tokens += num_tokens
        bar.set_postfix_str(
            f"{(tokens + kv_tokens) / (time.perf_counter() - ingest_started):.0f} tok/s"
        )

    try:
        with tqdm(total=len(docs), unit="doc", disable=args.quiet, file=sys.stderr) as bar:
            for doc in docs:
                kv_tokens = 0
                try:
                    result = services.ingestor.ingest(doc, progress, args.kv)
                except (KvMosaicError, SourceError, ValueError) as exc:
                    failed += 1
                    tqdm.write(f"kvmosaic: {doc.source}: not ingested: {exc}", file=sys.stderr)
                else:
                    added, present = added + result.created, present + (not result.created)
                    chunks += result.document.num_chunks if result.created else 0
                    tokens += result.num_tokens
                    conditioned += result.kv_conditioned
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - ingest_started):.0f} tok/s")
                bar.update(1)
    finally:
        services.close()
    now = time.perf_counter()
    print(
        f"ingested {added} new documents ({chunks} chunks, {tokens} tokens, "
        f"KV {args.kv or services.ingestor.kv}) in {now - started:.1f} s "
        f"({tokens / (now - ingest_started):.0f} tokens/s after start-up); "
        f"{present} already present; {failed} failed"
        + (f"; {conditioned} conditioned bases stored" if conditioned else "")
    )
    return 1 if failed else 0
