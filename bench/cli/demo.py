"""`kvmosaic bench demo`: the demo corpus's questions with exact golds, every mode, cold and warm
(bench/demo.py)."""

from __future__ import annotations

from app.cli.common import settings_overrides

MODES = "full,prefix,naive,epic,cacheblend,cachecraft"


def add_demo_parser(kinds, add_engine_arguments) -> None:
    p = kinds.add_parser(
        "demo", help="demo questions with exact golds: right answers per mode, cold and warm"
    )
    add_engine_arguments(p)
    p.add_argument("--modes", default=MODES, help=f"comma-separated modes (default {MODES})")
    p.add_argument("--fidelity", default="balanced", help="level of every request (balanced)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(handler=run_demo_command)


def run_demo_command(args) -> int:
    from bench.demo import format_demo, run_demo

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = run_demo(settings_overrides(args), modes, args.fidelity, args.max_tokens)
    print(format_demo(results))
    return 0
