"""What a workload run prints and writes: the table, JSON, and a markdown report with PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.workload.bound import throughput_bounds
from bench.workload.served import SERVED_KINDS
from bench.workload.summary import CellSummary
from bench.workload.trace import write_trace

COLUMNS = (
    "mode",
    "load",
    "ok",
    "err",
    "req/s",
    "TTFT p50",
    "p95",
    "p99",
    "lat p50",
    "p95",
    "tok/s",
    "dec tok/s",
    "CPU s/req",
    "work/full",
    "work/prefix",
    "bg",
    "recomp",
    "exact",
    "blend",
    "comp",
    "reord",
    "esc",
    "rep",
    "skip",
    "EM",
    "ROUGE-L",
    "KL",
    "top-1",
    "ans top-1",
    "ans KL",
    "KV MiB",
    "tier hits",
)


def format_table(summaries: list[CellSummary]) -> str:
    rows = [COLUMNS] + [_row(s) for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))
        )
        for r in rows
    )


def _row(s: CellSummary) -> tuple[str, ...]:
    f = s.fidelity
    return (
        s.mode,
        s.load,
        str(s.requests),
        str(s.errors),
        f"{s.throughput:.3f}",
        _ms(s.ttft_p50),
        _ms(s.ttft_p95),
        _ms(s.ttft_p99),
        _ms(s.latency_p50),
        _ms(s.latency_p95),
        f"{s.output_tokens_per_s:.1f}",
        _num(s.decode_tokens_per_s, 1),
        f"{s.cpu_s_per_request:.2f}",
        _ratio(s.work_vs_full),
        _ratio(s.work_vs_prefix),
        f"{s.background_share:.2f}",
        f"{s.recompute_share:.2f}",
        *served_cells(s),
        f"{s.reordered_share:.2f}",
        _num(s.escalated_share, 2),
        _num(s.repaired_share, 2),
        _num(s.skipped_share, 2),
        *(
            (
                f"{f.exact_match:.2f}",
                f"{f.rouge_l:.2f}",
                f"{f.first_kl:.3f}",
                f"{f.first_top1:.2f}",
                _num(f.answer_top1, 3),
                _num(f.answer_kl, 3),
            )
            if f
            else ("-",) * 6
        ),
        f"{sum(s.kv_bytes.values()) / 2**20:.0f}" if s.kv_bytes else "-",
        " ".join(f"{tier}:{hits}" for tier, hits in s.tier_hits.items() if hits),
    )


def served_cells(s: CellSummary) -> tuple[str, str, str]:
    """The shares of context tokens served exact, blended and computed
    (bench/workload/served.py)."""
    exact, blended, computed = (
        f"{s.served[k]:.2f}" if k in s.served else "-" for k in SERVED_KINDS
    )
    return exact, blended, computed


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}ms"


def _num(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_json(run) -> dict:
    """Everything a run measured, as JSON-ready data."""
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.options).items()}
    options["modes"] = [m.name for m in run.options.modes]
    snapshot = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.snapshot).items()}
    return {
        "options": options,
        "corpus": run.corpus,
        "snapshot": snapshot,
        "trace_stats": asdict(run.stats),
        "oracle": _oracle_json(run),
        "bounds": [
            {**asdict(b), "ratio": b.ratio}
            for b in throughput_bounds(run.summaries, getattr(run, "oracle", None))
        ],
        "environment": run.environment,
        "seconds": run.seconds,
        "floor": asdict(run.floor) if getattr(run, "floor", None) is not None else None,
        "accuracy": {label: asdict(a) for label, a in getattr(run, "accuracy", {}).items()},
        "cells": [s.as_dict() for s in run.summaries],
    }


def format_answers(run) -> str:
    """The floor (full in another chunk order against full) and, where the corpus has gold
    answers, each cell's accuracy with its 95% interval and the paired difference against full."""
    lines = []
    floor = getattr(run, "floor", None)
    if floor is not None:
        lines.append(
            f"floor: full in another chunk order against full, {floor.compared} distinct requests: "
            f"same answer {floor.exact_match:.2f}, ROUGE-L {floor.rouge_l:.3f}, first-token KL "
            f"{floor.first_kl:.4f}, top-1 {floor.first_top1:.2f}, ans top-1 "
            f"{_num(floor.answer_top1, 3)}, "
            f"ans KL {_num(floor.answer_kl, 3)}"
        )
    for label, scored in getattr(run, "accuracy", {}).items():
        versus = scored.versus_full
        paired = (
            "-" if versus is None else f"{versus.mean:+.3f} [{versus.low:+.3f}, {versus.high:+.3f}]"
        )
        lines.append(
            f"accuracy {label:<44} {scored.accuracy} over {scored.scored} requests; vs full "
            f"{paired}"
        )
    return "\n".join(lines)


def format_bounds(run) -> str:
    """Per load, the throughput the oracle's work would allow against full's
    (bench/workload/bound.py)."""
    bounds = throughput_bounds(run.summaries, getattr(run, "oracle", None))
    return "\n".join(b.line() for b in bounds)


def _oracle_json(run) -> dict | None:
    oracle = getattr(run, "oracle", None)
    if oracle is None:
        return None
    return {
        **asdict(oracle),
        "exact_share": oracle.exact_share,
        "rows_vs_full": oracle.rows_vs_full,
    }


def write_json(run, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run_json(run), indent=2, default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def write_report(run, directory: Path, command: str) -> Path:
    """`directory/README.md` with the table, trace statistics and plots; plus results.json,
    trace.jsonl."""
    from bench.workload.plots import draw_all

    directory.mkdir(parents=True, exist_ok=True)
    write_json(run, directory / "results.json")
    write_trace(directory / "trace.jsonl", run.trace)
    plots = draw_all(run.summaries, directory)
    path = directory / "README.md"
    path.write_text(_markdown(run, command, plots))
    return path


def _markdown(run, command: str, plots: list[str]) -> str:
    s, snap, env = run.stats, run.snapshot, run.environment
    lines = [
        "# Workload benchmark",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {env.get('cpus')} CPUs ({env.get('machine')}), device {env.get('device')}, "
        "torch "
        f"{env.get('torch')} with {env.get('torch_threads')} threads; server with "
        f"{env.get('workers')} workers, "
        f"queue {env.get('queue_size')}, tiers {_tiers(env.get('tiers'))}; model "
        f"{env.get('model')}. "
        f"Whole run: {run.seconds / 60:.1f} min.",
        "",
        f"Corpus {run.corpus}: {snap.documents} documents, {snap.chunks} chunks, {snap.tokens} "
        "tokens, "
        f"{snap.kv_bytes / 2**20:.0f} MiB of base KV, ingested in {snap.ingest_seconds:.0f} s "
        f"({'by an earlier run' if snap.reused else 'in this run'}).",
        "",
        f"Trace: {s.requests} requests ({s.reformulated:.0%} reformulated repeats), "
        f"{s.distinct_chunks} distinct "
        f"chunks retrieved; **{s.seen_before:.0%} of retrieved chunks had been retrieved before**. "
        "Chunk lists: "
        f"same as an earlier request in the same order {s.same_order:.0%}, in another order "
        f"{s.other_order:.0%}, "
        f"partly shared {s.partly:.0%}, nothing shared {s.fresh:.0%}.",
        "",
        *([f"Limit: {run.oracle.line()}.", ""] if getattr(run, "oracle", None) is not None else []),
        "```",
        format_table(run.summaries),
        "",
        *([bounds, ""] if (bounds := format_bounds(run)) else []),
        format_answers(run),
        "```",
        "",
        "Columns: answered requests and errors; throughput (answered requests per second of wall "
        "time, the",
        "background drain after the last answer included); TTFT from submission to the first "
        "answer piece",
        "(queue wait included) and end-to-end latency; output tokens/s over the wall time; CPU "
        "seconds of",
        "the whole process per request; model work per request (prefill FLOPs of every layer-row "
        "run, background",
        "variant builds and base KV computed on a miss included) over `full`'s and `prefix`'s at "
        "the same load,",
        "and the share of that work done off the request path (`bg`: background variant builds);",
        "mean share of context tokens recomputed; shares of context tokens served exact (from a "
        "variant computed",
        "after exactly the chunks before it), blended (reused from another context's KV) and "
        "computed (every layer),",
        "to read against the limit above (`bound`: the most req/s over full's that the oracle's "
        "work allows, from a fit of CPU s/req to work over the cells of a load, "
        "bench/workload/bound.py); "
        "share of requests whose chunks the order stage moved "
        "(`reord`);",
        "shares of requests the fidelity guard re-ran in full at the",
        "first token (`esc`) or moved to full prefill while decoding (`rep`); fidelity against "
        "`full` on the same request: greedy-answer",
        "exact match, ROUGE-L, first-token KL(full ‖ mode), first-token top-1 agreement, and along "
        "full's answer",
        "fed to the mode (teacher forcing, pooled over answer positions) top-1 agreement and mean "
        "KL (teacher forcing runs the prefill's weights: `full`'s own `ans top-1` can be below 1 "
        "where its answer was decoded with rounded decode weights, near-ties falling the other "
        "way); the",
        "store's KV after the cell (`KV MiB`: ready variants, base and context, after the "
        "background drain);",
        "store hits per tier. Teacher forcing runs on the client thread between its requests, "
        "inside the wall time.",
        "",
        *_kv_lines(run.summaries),
    ]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def _kv_lines(summaries: list[CellSummary]) -> list[str]:
    """Per cell, the store's KV after it by kind and codec (`base:<codec>`, `context:<codec>`)."""
    lines = [
        f"- {s.mode} {s.load}: "
        + ", ".join(f"{kind} {size / 2**20:.0f} MiB" for kind, size in sorted(s.kv_bytes.items()))
        for s in summaries
        if s.kv_bytes
    ]
    return ["KV in the store after each cell:", "", *lines, ""] if lines else []


def _tiers(tiers: str | list[str] | None) -> str:
    """The store tiers as "cpu, disk", whether the settings held them as "cpu,disk" or a list."""
    names = tiers.split(",") if isinstance(tiers, str) else list(tiers or ())
    return ", ".join(n.strip() for n in names if n.strip()) or "none"
