"""`kvmosaic calibrate alpha`: fit Cache-Craft's α to a fidelity target and print the curve;
`kvmosaic calibrate profile`: measure a model's reuse profile (bench/cli/profile.py)."""

from __future__ import annotations

from app.cli.common import (
    add_dataset_arguments,
    add_engine_arguments,
    add_warmup_arguments,
    engine_config,
)


def add_parser(subparsers) -> None:
    from bench.cli.profile import add_profile_parser

    calibrate = subparsers.add_parser(
        "calibrate", help="measure what a model's reuse may do: its profile, cachecraft's alpha"
    )
    kinds = calibrate.add_subparsers(dest="what", required=True)
    add_profile_parser(kinds)
    add_alpha_parser(kinds)


def add_alpha_parser(kinds) -> None:
    parser = kinds.add_parser("alpha", help="fit cachecraft's alpha on a dataset slice")
    add_engine_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument(
        "--alphas", default="0.1,0.25,0.5,1,1.5,2", help="candidate alphas, comma-separated"
    )
    parser.add_argument(
        "--target-kl",
        type=float,
        default=None,
        help="mean first-token KL to meet (default: cacheblend's on the same records)",
    )
    parser.add_argument(
        "--swap",
        type=int,
        default=2,
        help="chunks of each warm-up request taken from another record (default 2)",
    )
    add_warmup_arguments(
        parser,
        default=3,
        help="untimed cachecraft requests over partly shared chunk lists "
        "whose built variants the α candidates choose from (default 3)",
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    from bench.fidelity.calibrate import CalibrateOptions, fit_alpha, format_curve, run_calibration
    from engine.engine import Engine

    alphas = tuple(sorted(float(a) for a in args.alphas.split(",") if a.strip()))
    options = CalibrateOptions(
        dataset=args.dataset,
        start=args.start,
        n=args.n,
        chunks=args.chunks,
        alphas=alphas,
        target_kl=args.target_kl,
        warmup_orders=args.warmup_orders,
        seed=args.seed,
        swap=args.swap,
    )
    points, blend = run_calibration(Engine.load(engine_config(args)), options)
    print(
        f"cachecraft on records {args.start}..{args.start + args.n - 1}, "
        f"{args.warmup_orders} warm-up "
        f"requests each sharing {args.chunks - args.swap} of {args.chunks} chunks"
    )
    print(format_curve(points, blend))
    target = blend.mean_kl if args.target_kl is None else args.target_kl
    best, met = fit_alpha(points, target)
    if met:
        print(
            f"fit: alpha {best.alpha:g} (mean KL {best.mean_kl:.4f} <= {target:.4f}, "
            f"{best.recompute_share:.1%} recomputed); set KVMOSAIC_CRAFT_ALPHA={best.alpha:g}"
        )
        return 0
    print(
        f"no alpha meets KL <= {target:.4f}; lowest KL at alpha {best.alpha:g} ({best.mean_kl:.4f})"
    )
    return 1
