"""What the server-side subcommands share: settings from the environment plus a few flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None, help="overrides KVMOSAIC_DATA_DIR")


def settings_from(args, **overrides):
    """Settings from KVMOSAIC_* variables, with the given flags on top (None = not given)."""
    from app.settings import Settings

    values = {"data_dir": getattr(args, "data_dir", None), **overrides}
    return Settings(**{k: v for k, v in values.items() if v is not None})


def setting_errors(exc: ValidationError) -> list[str]:
    """One line per refused setting: its variable, the value given and what it accepts, e.g.
    `KVMOSAIC_DEVIATION='query': Input should be 'value' or 'key'`."""
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]).upper() if error["loc"] else "?"
        variable = name if name.startswith("KVMOSAIC_") else f"KVMOSAIC_{name}"  # an alias
        given = f"={error['input']!r}" if not isinstance(error["input"], dict) else ""
        lines.append(f"{variable}{given}: {error['msg']}")
    return lines
