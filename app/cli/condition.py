"""`kvmosaic condition`: compute the neighbour-conditioned bases a corpus lacks.

With `KVMOSAIC_CONDITIONED_NEIGHBOURS` set, an eager ingest computes each new chunk's
conditioned base; this computes them for chunks ingested before (or lazily, or while the
setting was off, or under another `KVMOSAIC_CONDITIONED_LEAD_TOKENS`), each after its nearest
chunks in the whole index. Chunks that have one of this kind are skipped, so an interrupted run
resumes where it stopped. `--all` recomputes every chunk's, neighbours drawn from the whole
index as it stands: an ingest draws them from the documents ingested before and its own, so the
first documents of a corpus get theirs from few. It may run beside a server on the same
catalog and store: a request reads a chunk's conditioned base once its catalog row is there.
The progress bar counts chunks and shows tokens computed (leads and chunks) per second.
"""

from __future__ import annotations

import sys
import time

from app.cli.common import add_settings_arguments, settings_from


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "condition", help="compute the neighbour-conditioned bases the corpus lacks"
    )
    add_settings_arguments(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help="recompute every chunk's, neighbours from the whole index as it stands (an "
        "ingest draws them from the documents ingested before, and its own)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from tqdm import tqdm

    from app.services import conditioner_of
    from app.startup import start_services

    settings = settings_from(args)
    if settings.conditioning() is None:
        print(
            "kvmosaic: error: conditioned bases are off: set KVMOSAIC_CONDITIONED_NEIGHBOURS "
            "(how many nearest chunks precede each base)",
            file=sys.stderr,
        )
        return 2
    services = start_services(settings)  # a failed start: one line (StartFailure)
    started, computed = time.perf_counter(), 0

    def progress(tokens: int) -> None:
        nonlocal computed
        computed += tokens
        bar.update(1)
        bar.set_postfix_str(f"{computed / (time.perf_counter() - started):.0f} tok/s")

    try:
        conditioner = conditioner_of(
            settings, services.engine, services.retriever, services.catalog, services.chunk_cache
        )
        assert conditioner is not None  # the settings say conditioning is on
        total = len(services.retriever)
        with tqdm(total=total, unit="chunk", disable=args.quiet, file=sys.stderr) as bar:
            stored, present = conditioner.backfill(
                progress, on_present=lambda: bar.update(1), again=args.all
            )
    finally:
        services.close()
    print(
        f"conditioned bases ({settings.conditioned_neighbours} neighbours, "
        f"{settings.conditioned_lead_tokens} lead tokens each): {stored} computed, {present} "
        f"already there, in {time.perf_counter() - started:.1f} s ({computed} tokens computed)"
    )
    return 0
