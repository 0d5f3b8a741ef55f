"""The `kvmosaic` command. Each subcommand lives in its own module with `add_parser(subparsers)`.

Adding a subcommand is one new module plus one line in `SUBCOMMANDS`. Commands that are not
part of the product (the benchmarks of `bench/`: `kvmosaic bench`, `kvmosaic calibrate`) come in
as plugins, through the `kvmosaic.commands` entry points that pyproject.toml declares, so the
product imports nothing from them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

from pydantic import ValidationError

from app.cli import ask, condition, ingest, models, serve, settings
from app.cli.common import setting_errors

SUBCOMMANDS = [serve, ingest, condition, ask, settings, models]
PLUGIN_GROUP = "kvmosaic.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmosaic", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    for plugin in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            add = plugin.load()
        except ModuleNotFoundError:  # an install without the benchmarks (the Docker image)
            continue
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Model loading draws a "Loading weights" bar per model; ours draw the bars that matter.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from engine.errors import InvalidRequest, KvMosaicError

    try:
        return int(args.handler(args) or 0)
    except ValidationError as exc:  # a bad KVMOSAIC_* variable: name it and its allowed values
        for line in setting_errors(exc):
            print(f"kvmosaic: error: {line}", file=sys.stderr)
        return 2
    except InvalidRequest as exc:
        print(f"kvmosaic: error: {exc}", file=sys.stderr)
        return 2
    except KvMosaicError as exc:
        print(f"kvmosaic: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
