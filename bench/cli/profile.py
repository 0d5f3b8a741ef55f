"""`kvmosaic calibrate profile`: measure which blends `balanced` may run on a model, and write
its reuse profile (engine/serving/profile.py) by the rule of docs/benchmarks/profiles.md.

It generates answerable cases of a tuning seed, runs the fidelity bench with `full` and each
candidate mode's guarded blend (`MODE[reuse_profile=off]` at `balanced`) in two chunk orders,
judges every row (bench/fidelity/profile_rule.py) and writes the profile: by default where the
server looks for a calibrated one (`data_dir/profiles/<fingerprint>.json`), or `--out`.
`--from REPORT.json` judges a finished `bench fidelity --json` run instead of running one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from app.cli.common import add_engine_arguments, engine_config

CANDIDATES = "cachecraft,cacheblend"


def add_profile_parser(kinds) -> None:
    parser = kinds.add_parser(
        "profile", help="measure which blends balanced may run on a model; write its profile"
    )
    add_engine_arguments(parser)
    parser.add_argument("--modes", default=CANDIDATES, help=f"candidate modes ({CANDIDATES})")
    parser.add_argument("--seed", type=int, default=7, help="tuning seed of the cases (0-999)")
    parser.add_argument("--n", type=int, default=100, help="cases (a pass needs 100)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        help="judge this `bench fidelity --json` report instead of running",
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write the profile")
    parser.add_argument(
        "--report", type=Path, default=None, help="also write the fidelity report's JSON here"
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    from bench.fidelity.cases import TUNING_SEEDS
    from bench.fidelity.profile_rule import decide
    from engine.errors import InvalidRequest
    from engine.model.known import configured_known_model
    from engine.serving.profile import calibrated_path, write_profile

    if args.seed not in TUNING_SEEDS:
        raise InvalidRequest(
            f"--seed {args.seed} is not a tuning seed (0-999): never decide "
            "a profile on report seeds"
        )
    config = engine_config(args)
    known = configured_known_model(config.model, config.model_path)
    payload, fingerprint = _report(args) if args.source is None else (_read(args.source), None)
    model = known.name if known else (fingerprint or payload["options"].get("model", "?"))
    cases = {"seeds": "tuning", "seed": args.seed, "n": payload["options"]["n"]}
    profile, record = decide(payload, model, "docs/benchmarks/profiles.md", cases)
    out = args.out or calibrated_path(config.data_dir, fingerprint or _fingerprint(config))
    write_profile(out, profile, record)
    for trial in record["trials"]:
        verdict = "passes" if trial["passed"] else "fails"
        print(f"{trial['row']}: {verdict} ({trial['why']}; {trial['cases']} cases)")
    print(f"profile: {profile.allowed}; wrote {out}")
    return 0


def _report(args) -> tuple[dict[str, Any], str]:
    """Run the fidelity bench on generated tuning cases; its report as JSON, and the model's
    fingerprint."""
    import tempfile

    from bench.fidelity.cases import generate_cases
    from bench.fidelity.fidelity import FidelityOptions, format_table, run_fidelity, write_json
    from engine.engine import Engine
    from engine.serving.threads import single_threaded

    folder = Path(tempfile.mkdtemp(prefix="kvmosaic-profile-"))
    dataset = folder / f"cases-{args.seed}.json"
    dataset.write_text(json.dumps(generate_cases(args.seed, args.n)))
    modes = ("full",) + tuple(
        f"{m.strip()}[reuse_profile=off]" for m in args.modes.split(",") if m.strip()
    )
    options = FidelityOptions(
        dataset=dataset,
        n=args.n,
        modes=modes,
        orders=2,
        max_new_tokens=args.max_new_tokens,
        fidelity="balanced",
    )
    engine = Engine.load(engine_config(args))
    single_threaded()
    summaries = run_fidelity(engine, options)
    print(format_table(summaries), file=sys.stderr)
    report = args.report or folder / "fidelity.json"
    write_json(summaries, options, report)
    engine.close()
    return _read(report), engine.fingerprint


def _read(path: Path) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(Path(path).read_text())
    return payload


def _fingerprint(config) -> str:
    from engine.model.loader import load_model

    loaded = load_model(
        config.data_dir,
        config.model_path,
        config.device,
        config.dtype,
        config.linear_kernel,
        config.model,
    )
    return loaded.fingerprint
