"""What the server-side subcommands share: settings from the environment plus a few flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from engine.config import SELECTIONS
from engine.model.known import MODEL_NAMES


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None, help="overrides KVMOSAIC_DATA_DIR")


def settings_from(args, **overrides):
    """Settings from KVMOSAIC_* variables, with the given flags on top (None = not given); a
    KVMOSAIC_* variable that no setting reads is logged as a WARNING (`app.environment`)."""
    from app.environment import warn_unknown_variables
    from app.settings import Settings

    warn_unknown_variables()
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
        message = str(error["msg"]).removeprefix("Value error, ")  # a validator's own message
        lines.append(f"{variable}{given}: {message}")
    return lines


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Which records of a {question, answers, ctxs} dataset a benchmark runs, and how many
    passages."""
    parser.add_argument(
        "--dataset", type=Path, required=True, help="JSON list of {question, answers, ctxs}"
    )
    parser.add_argument("--start", type=int, default=0, help="first record (default 0)")
    parser.add_argument("--n", type=int, default=20, help="number of records (default 20)")
    parser.add_argument("--chunks", type=int, default=6, help="passages per prompt (default 6)")


def add_warmup_arguments(
    parser: argparse.ArgumentParser, default: int = 0, help: str | None = None
) -> None:
    """Variant warm-up: untimed requests in other orders leave variants before timing."""
    parser.add_argument(
        "--warmup-orders",
        type=int,
        default=default,
        help=help
        or f"untimed requests in other orders before timing, adding a warm row per mode "
        f"that leaves variants, with its cost (default {default}: cold only)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the warm-up orders")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options; each defaults to its `KVMOSAIC_*` setting (`kvmosaic settings`)."""
    parser.add_argument("--data-dir", type=Path, default=None)
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        type=model_argument,
        default=None,
        metavar="NAME",
        help=f"a model by name ({', '.join(MODEL_NAMES)}: `kvmosaic models`), or a local "
        "checkpoint path; replaces KVMOSAIC_MODEL and KVMOSAIC_MODEL_PATH",
    )
    model.add_argument(
        "--model-path",
        default=None,
        metavar="PATH",
        help="a local checkpoint: Hugging Face folder or .gguf file; replaces KVMOSAIC_MODEL "
        "and KVMOSAIC_MODEL_PATH (default: the embedded SmolLM2)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda[:n]")
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--check-layers", default=None, help="cacheblend check layers, e.g. 1 or 1,2,3"
    )
    parser.add_argument(
        "--check-multipliers", default=None, help="ratio multiplier per check layer, e.g. 2,1.5,1"
    )
    parser.add_argument("--deviation", choices=["value", "key"], default=None)
    parser.add_argument(
        "--selection", choices=SELECTIONS, default=None, help="how check layers rank rows"
    )
    parser.add_argument(
        "--blend-head-tokens",
        type=int,
        default=None,
        help="opening rows of each chunk cached in another context recomputed first",
    )
    parser.add_argument("--epic-tokens", type=int, default=None)
    parser.add_argument("--craft-alpha", type=float, default=None)
    parser.add_argument("--craft-novelty", choices=["true", "false"], default=None)
    parser.add_argument(
        "--focus-layer", default=None, help="early termination from this layer (off: never)"
    )
    parser.add_argument("--focus-threshold", type=float, default=None)


def model_argument(value: str) -> str:
    """`--model`: a known model's name, or (as before names) a checkpoint path that exists."""
    if value in MODEL_NAMES or Path(value).exists():
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a known model ({', '.join(MODEL_NAMES)}) nor an existing path"
    )


def model_overrides(args) -> dict:
    """The model the command line names, replacing both model variables: a name in `model`, a
    path in `model_path` ("" clears the other one); {} when it names none."""
    name, path = getattr(args, "model", None), getattr(args, "model_path", None)
    if name is not None and name not in MODEL_NAMES:
        name, path = None, name
    if name is None and path is None:
        return {}
    return {"model": name or "", "model_path": path or ""}


# command-line option -> Settings field (the model: `model_overrides`)
_OVERRIDES = {
    "data_dir": "data_dir",
    "device": "device",
    "dtype": "dtype",
    "threads": "num_threads",
    "check_layers": "check_layers",
    "check_multipliers": "check_multipliers",
    "deviation": "deviation",
    "selection": "selection",
    "epic_tokens": "epic_tokens",
    "blend_head_tokens": "blend_head_tokens",
    "craft_alpha": "craft_alpha",
    "craft_novelty": "craft_novelty",
    "focus_layer": "focus_layer",
    "focus_threshold": "focus_threshold",
}


def settings_overrides(args) -> dict:
    """The Settings fields that the command line's engine options set (those given)."""
    return {
        **{
            field: getattr(args, option)
            for option, field in _OVERRIDES.items()
            if getattr(args, option, None) is not None
        },
        **model_overrides(args),
    }


def engine_config(args):
    """Settings from the environment, with the options given on the command line on top."""
    from app.settings import Settings

    return Settings(**settings_overrides(args)).engine_config()
