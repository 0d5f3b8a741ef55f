"""`python -m bench.fidelity.guard_signals`: which first-token signal tells a far blend from a near
\
one.

The balanced guard (engine/serving/guard.py) re-runs a request in full when its blended first token
looks uncertain. A signal is worth as much as the first-token KL(full ‖ mode) it removes per
request it re-runs. Per record of a dataset slice (cold: base variants only), this runs `full`
and the mode at `fast` (no guard), and from the mode's first-token logits alone computes:

- `margin`: log-probability of the top token over the runner-up, nats (the guard's signal);
- `entropy`: of the mode's first-token distribution, nats;
- `top_prob`: probability of the mode's top token.

It prints each signal's Spearman rank correlation with the KL (sign turned so that higher
means "re-run first"), and, for re-run budgets of 10-50% of the requests, the mean KL left
when the guard re-runs that share of requests, most suspicious first by each signal, next to
the oracle (the requests of highest KL first). Signals are compared at equal cost, since a
re-run's cost is the same whoever is re-run.

Chunks are the record's first `chunks` passages cut to `chunk_tokens` tokens (the workload's
chunker caps chunks at 256 tokens), so the prompts look like the server's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.fidelity.fidelity import DatasetSlice, Record, record_chunk_id
from bench.fidelity.metrics import kl_divergence
from engine.config import EngineConfig, Fidelity
from engine.engine import Engine
from engine.plan import ChunkInput
from engine.planners import Mode, reference_mode
from engine.serving.guard import first_token_margin

SIGNALS = ("margin", "entropy", "top_prob")
# higher value = more suspicious: margin and top_prob are turned around
SUSPICION_SIGN = {"margin": -1.0, "entropy": 1.0, "top_prob": -1.0}
BUDGETS = (0.1, 0.25, 0.5)


@dataclass(frozen=True)
class SignalOptions(DatasetSlice):
    mode: str = "cacheblend"
    chunk_tokens: int = 256


@dataclass(frozen=True)
class SignalRow:
    """One record: the mode's first-token KL against full, and the signals of its logits."""

    index: int
    kl: float
    margin: float
    entropy: float
    top_prob: float


def first_token_signals(logits: torch.Tensor) -> dict[str, float]:
    """margin, entropy and top_prob of one first-token logits vector [vocab]."""
    logp = torch.log_softmax(logits.double(), -1)
    return {
        "margin": first_token_margin(logits),
        "entropy": float(-(logp.exp() * logp).sum()),
        "top_prob": float(logp.max().exp()),
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan with fewer than 2 points or a
    constant side."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two lists of the same length")
    rx, ry = _ranks(xs), _ranks(ys)
    if len(xs) < 2 or len(set(rx)) < 2 or len(set(ry)) < 2:
        return math.nan
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def kl_left(rows: list[SignalRow], suspicion: list[float], budget: float) -> float:
    """Mean KL over all rows once the ⌈budget·n⌉ rows of highest `suspicion` are re-run (KL 0)."""
    rerun = set(
        sorted(range(len(rows)), key=lambda i: -suspicion[i])[: math.ceil(budget * len(rows))]
    )
    return statistics.fmean(0.0 if i in rerun else r.kl for i, r in enumerate(rows))


def suspicion_of(rows: list[SignalRow], signal: str) -> list[float]:
    """Each row's suspicion by `signal` (higher: re-run first); `oracle` ranks by KL itself."""
    if signal == "oracle":
        return [r.kl for r in rows]
    return [SUSPICION_SIGN[signal] * getattr(r, signal) for r in rows]


def record_chunks(
    engine: Engine, record: Record, options: SignalOptions, index: int
) -> list[ChunkInput]:
    chunks = []
    for i, ctx in enumerate(record["ctxs"][: options.chunks]):
        ids = engine.chunk_ids(ctx["text"], ctx.get("title", ""))[: options.chunk_tokens]
        chunks.append(ChunkInput(record_chunk_id(index, i), ids, engine.encode_chunk(ids)))
    return chunks


def measure(engine: Engine, options: SignalOptions, progress: bool = True) -> list[SignalRow]:
    """One row per record of the slice: full and the mode (at `fast`) on the same base variants."""
    rows = []
    records = options.records()
    for offset, record in enumerate(
        tqdm(records, desc="signals", unit="record", file=sys.stderr, disable=not progress)
    ):
        index = options.start + offset
        chunks = record_chunks(engine, record, options, index)
        reference = engine.prefill(chunks, record["question"], reference_mode(), Fidelity.EXACT)
        blended = engine.prefill(
            chunks, record["question"], Mode.named(options.mode), Fidelity.FAST
        )
        assert (
            reference.logits is not None and blended.logits is not None
        )  # prefill keeps the logits
        rows.append(
            SignalRow(
                index,
                kl_divergence(reference.logits, blended.logits),
                **first_token_signals(blended.logits),
            )
        )
    return rows


def summarize(rows: list[SignalRow]) -> dict[str, dict[str, float]]:
    """Per signal (and the oracle): Spearman with KL (suspicion sign) and KL left per budget."""
    kls = [r.kl for r in rows]
    table = {}
    for signal in (*SIGNALS, "oracle"):
        suspicion = suspicion_of(rows, signal)
        figures = {"spearman": spearman(suspicion, kls)}
        figures.update(
            {f"kl_left@{budget:g}": kl_left(rows, suspicion, budget) for budget in BUDGETS}
        )
        table[signal] = figures
    return table


def format_summary(rows: list[SignalRow], table: dict[str, dict[str, float]]) -> str:
    lines = [
        f"{len(rows)} records, mean first-token KL with no re-run: "
        f"{statistics.fmean(r.kl for r in rows):.4f}",
        f"{'signal':10} {'spearman':>8} "
        + " ".join(f"{'KL left @' + format(b, '.0%'):>13}" for b in BUDGETS),
    ]
    for signal, figures in table.items():
        lines.append(
            f"{signal:10} {figures['spearman']:8.3f} "
            + " ".join(f"{figures[f'kl_left@{b:g}']:13.4f}" for b in BUDGETS)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fidelity.guard_signals", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dataset", type=Path, default=Path("../shared/data/cacheblend/musique_s.json")
    )
    parser.add_argument("--start", type=int, default=0, help="first record (tune on 0-99)")
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--mode", default="cacheblend")
    parser.add_argument("--json", type=Path, default=None, help="write rows and summary here")
    args = parser.parse_args(argv)
    if args.n < 1 or args.chunks < 1 or args.chunk_tokens < 1:
        parser.error("--n, --chunks and --chunk-tokens must be at least 1")
    options = SignalOptions(
        dataset=args.dataset,
        start=args.start,
        n=args.n,
        chunks=args.chunks,
        mode=args.mode,
        chunk_tokens=args.chunk_tokens,
    )
    engine = Engine.load(EngineConfig())
    rows = measure(engine, options)
    table = summarize(rows)
    print(format_summary(rows, table))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "options": {**asdict(options), "dataset": str(options.dataset)},
                    "rows": [asdict(r) for r in rows],
                    "summary": table,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
