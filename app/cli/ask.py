"""`kvmosaic ask "question"`: answer from the command line, in-process or via a running server."""

from __future__ import annotations

import json
import sys

from app.cli.common import add_settings_arguments, settings_from
from engine.config import FIDELITIES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("ask", help="answer a question over the ingested documents")
    add_settings_arguments(parser)
    parser.add_argument("question")
    parser.add_argument(
        "--mode", default=None, help="recompute mode (default: KVMOSAIC_DEFAULT_MODE)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="chunks to retrieve")
    parser.add_argument("--ratio", type=float, default=None, help="recompute ratio for cacheblend")
    parser.add_argument(
        "--fidelity",
        choices=FIDELITIES,
        default=None,
        help="fidelity guard: fast, balanced or exact (default: KVMOSAIC_FIDELITY)",
    )
    parser.add_argument(
        "--packets",
        action="store_true",
        default=None,
        help="read each chunk between the server's learned packets (KVMOSAIC_PACKETS; "
        "fidelity fast, a mode that reads base variants only)",
    )
    parser.add_argument(
        "--conditioned",
        action="store_true",
        default=None,
        help="read each chunk's neighbour-conditioned base (KVMOSAIC_CONDITIONED_NEIGHBOURS; "
        "fidelity fast, a mode that reads base variants only)",
    )
    parser.add_argument(
        "--ape",
        action="store_true",
        default=None,
        help="read the chunks by APE's attention (KVMOSAIC_APE_TEMPERATURE, "
        "KVMOSAIC_APE_SCALE; fidelity fast, a mode that reads base variants only)",
    )
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--server", default=None, help="ask a running server, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.set_defaults(handler=run)


def run(args) -> int:
    body = {
        "question": args.question,
        "mode": args.mode,
        "top_k": args.top_k,
        "ratio": args.ratio,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "fidelity": args.fidelity,
        "packets": args.packets,
        "conditioned": args.conditioned,
        "ape": args.ape,
    }
    body = {k: v for k, v in body.items() if v is not None}
    report = ask_server(args.server, body) if args.server else ask_here(args, body)
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def ask_here(args, body: dict) -> dict:
    from app.report import ask_response
    from app.startup import start_services

    services = start_services(settings_from(args))  # a failed start: one line (StartFailure)
    try:
        query = services.rag.query(
            **{k: v for k, v in body.items() if k != "question"}, question=body["question"]
        )
        answer = services.rag.ask(query, on_piece=None if args.json else _echo)
        if not args.json:
            print()
        return ask_response(answer).model_dump(mode="json")
    finally:
        services.close()


def ask_server(url: str, body: dict) -> dict | None:
    import httpx

    with httpx.Client(base_url=url, timeout=300) as client:
        response = client.post("/ask", json=body)
    if response.status_code != 200:
        print(
            f"kvmosaic: {response.status_code}: {response.json()['error']['message']}",
            file=sys.stderr,
        )
        return None
    report = response.json()
    print(report["answer"])
    return report


def print_report(report: dict) -> None:
    t, u = report["timings"], report["usage"]
    print(
        f"\nmode {report['mode']}: TTFT {t['ttft_ms']:.0f} ms (retrieve "
        f"{t['retrieve_ms']:.0f}, load {t['load_ms']:.0f}, prefill {t['prefill_ms']:.0f}), "
        f"decode {t['decode_ms']:.0f} ms, total {t['total_ms']:.0f} ms; recomputed "
        f"{u['recomputed_tokens']}/{u['context_tokens']} context tokens"
    )
    if report.get("guard"):
        print(guard_line(report["guard"]))
    for c in report["chunks"]:
        stop = f", stopped at layer {c['stopped_layer']}" if c["stopped_layer"] is not None else ""
        print(
            f"  {c['score']:.3f}  {c['document'][:40]:40}  reused {c['reused']:4} recomputed "
            f"{c['recomputed']:4}  variant {c['variant']}{stop}"
        )


def guard_line(guard: dict) -> str:
    """One line: the guard's level, its estimate, and what it spent."""
    margin = "n/a" if guard["margin"] is None else f"{guard['margin']:.2f} nats"
    action = (
        f"re-ran in full ({guard['spent_ms']:.0f} ms)"
        if guard["escalated"]
        else "kept the mode's prefill"
    )
    if guard.get("exact_first"):
        action = "exact-first (no blend holds on this model): computed after the exact prefix"
    if guard.get("skipped_blend"):
        action = "skipped the blend, the server being busy: computed exactly after the exact prefix"
    if guard.get("repaired_at") is not None:
        why = f"had margin {guard['repair_margin']:.2f} nats"
        if guard.get("repair_reason") == "grounding":
            why = f"named {guard['repair_span']!r}, in no passage"
        elif guard.get("repair_span") is not None:
            why = (
                f"began {guard['repair_span']!r}, held back when a margin fell to "
                f"{guard['repair_margin']:.2f} nats"
            )
        action += (
            f"; answer token {guard['repaired_at']} {why}, "
            f"went on from full prefill ({guard['repair_ms']:.0f} ms)"
        )
    return f"fidelity {guard['fidelity']}: first-token margin {margin}; {action}"


def _echo(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()
