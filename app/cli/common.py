"""What the server-side subcommands share: settings from the environment plus a few flags."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None, help="overrides KVMOSAIC_DATA_DIR")


def settings_from(args, **overrides):
    """Settings from KVMOSAIC_* variables, with the given flags on top (None = not given)."""
    from app.settings import Settings

    values = {"data_dir": getattr(args, "data_dir", None), **overrides}
    return Settings(**{k: v for k, v in values.items() if v is not None})
