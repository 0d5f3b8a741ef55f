"""`kvmosaic calibrate`: fit Cache-Craft's α to a fidelity target and print the curve."""

from __future__ import annotations

from app.cli.bench import add_dataset_arguments, add_engine_arguments, add_warmup_arguments, engine_config


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="fit cachecraft's alpha on a dataset slice")
    add_engine_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.3,0.5,1", help="candidate alphas, comma-separated")
    parser.add_argument("--target-kl", type=float, default=0.05, help="mean first-token KL to meet (default 0.05)")
    add_warmup_arguments(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    from engine.bench.calibrate import CalibrateOptions, fit_alpha, format_curve, run_calibration
    from engine.engine import Engine

    alphas = tuple(sorted(float(a) for a in args.alphas.split(",") if a.strip()))
    options = CalibrateOptions(dataset=args.dataset, start=args.start, n=args.n, chunks=args.chunks,
                               alphas=alphas, target_kl=args.target_kl, warmup_orders=args.warmup_orders,
                               seed=args.seed)
    points = run_calibration(Engine.load(engine_config(args)), options)
    print(f"cachecraft on records {args.start}..{args.start + args.n - 1}, {args.warmup_orders} warm-up orders")
    print(format_curve(points))
    best, met = fit_alpha(points, args.target_kl)
    if met:
        print(f"fit: alpha {best.alpha:g} (mean KL {best.mean_kl:.4f} <= {args.target_kl}, "
              f"{best.recompute_share:.1%} recomputed); set KVMOSAIC_CRAFT_ALPHA={best.alpha:g}")
        return 0
    print(f"no alpha meets KL <= {args.target_kl}; lowest KL at alpha {best.alpha:g} ({best.mean_kl:.4f})")
    return 1
