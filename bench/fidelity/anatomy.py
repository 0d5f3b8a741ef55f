"""Where reuse loses the answer: hybrid caches and focus probes on cases full prefill answers.

    python -m bench.fidelity.anatomy --model qwen2.5-coder-0.5b --dataset cases.json --n 30 \\
        --probe-layer 9

Only records that full prefill answers right (gold contained in its greedy answer) count, so
every row reads as "of what full gets right, what this keeps". Every row decodes greedily.
- Hybrid rows: each chunk's KV is the naive reuse of its base variant (computed alone after the
  system prefix, moved to its place) with some rows replaced by full prefill's own KV (exact in
  this prompt) -- the answer-bearing chunk (the passage whose title the question names), the
  others, the chunks before / after it, each chunk's first tokens, or one quarter of the layers.
  The question is then computed over that cache: which part of the deviation costs the answer.
- Blend rows: `cacheblend` at two ratios, its default check layers and single check layers.
- Focus rows: the question's rows run alone over the naive cache up to `--probe-layer`; each
  context row scores the most attention a question row pays it there (mean over heads); the
  top chunk(s) and / or the top share of rows are recomputed from layer 0, the rest reused.
  `oracle` rows recompute the answer-bearing chunk instead of the probe's.
Reports, per row, the accuracy over the kept records and the recomputed share of context rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.fidelity.accuracy import score_answer
from bench.fidelity.fidelity import Record, base_variant_chunks, load_dataset
from engine.config import EngineConfig, Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.kv import ChunkKV
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput, Plan, PlanRequest, positions
from engine.planners import Mode
from engine.planners.focus import question_peak, ranked_chunks, top_focus
from engine.result import PrefillResult
from engine.serving.guard import GuardReport

TOKENS = 16
CHUNKS = 6


@dataclasses.dataclass
class Case:
    """One kept record: its question, golds, base variants, full and naive prefills."""

    question: str
    golds: list[str]
    base: list[ChunkInput]
    answer: int  # index of the answer-bearing chunk
    full: PrefillResult
    naive: PrefillResult
    request: PlanRequest


class Anatomy:
    def __init__(self, engine: Engine, probe_layer: int):
        self.engine, self.probe_layer = engine, probe_layer
        self.layers = engine.loaded.spec.num_layers
        self.params = SamplingParams(max_new_tokens=TOKENS)
        self.rows: dict[str, list[tuple[bool, float]]] = {}

    def answer(self, result: PrefillResult) -> str:
        return read_out(self.engine.generate(result, self.params))[0].strip()

    def prefill(
        self,
        chunks: list[ChunkInput],
        question: str,
        mode: str,
        ratio: float | None = None,
        settings: dict[str, Any] | None = None,
    ) -> PrefillResult:
        config = dataclasses.replace(self.engine.config, **(settings or {}))
        return self.engine.prefill(
            chunks,
            question,
            Mode.named(mode),
            Fidelity.FAST,
            ratio=ratio,
            max_new_tokens=TOKENS,
            config=config,
        )

    def case(self, record: Record, index: int) -> Case | None:
        question, golds = record["question"], record.get("answers", [])
        base = base_variant_chunks(self.engine, record, CHUNKS, index)
        plain = [ChunkInput(c.chunk_id, c.token_ids) for c in base]
        full = self.prefill(plain, question, "full")
        titles = [c.get("title", "") for c in record["ctxs"][:CHUNKS]]
        named = [i for i, title in enumerate(titles) if title and title in question]
        if len(named) != 1 or not score_answer(self.answer(full), golds).contains:
            return None  # not single-hop, or full prefill misses it: nothing to lose
        naive = self.prefill(base, question, "naive")
        layout = full.layout
        request = PlanRequest(
            layout,
            tuple(base),
            self.engine.prefix_kv,
            0.0,
            self.engine.config,
            self.layers,
            Fidelity.FAST,
        )
        return Case(question, golds, base, named[0], full, naive, request)

    def score(self, name: str, case: Case, result: PrefillResult, share: float) -> None:
        ok = bool(score_answer(self.answer(result), case.golds).contains)
        self.rows.setdefault(name, []).append((ok, share))

    def run_case(self, case: Case) -> None:
        for name, (layers, tokens) in hybrids(case, self.layers).items():
            self.score(name, case, self.hybrid(case, layers, tokens), 0.0)
        for ratio in (0.15, 0.3):
            result = self.prefill(case.base, case.question, "cacheblend", ratio=ratio)
            self.score(
                f"cacheblend r={ratio} (default checks)", case, result, result.recompute_share
            )
            for check in (1, 4, 8):
                single = dict(check_layers=(check,), check_ratio_multipliers=(1.0,))
                result = self.prefill(
                    case.base,
                    case.question,
                    "cacheblend",
                    ratio=ratio,
                    settings=dict(single, blend_head_tokens=0, focus_layer=None),
                )
                self.score(
                    f"cacheblend r={ratio} check {check}", case, result, result.recompute_share
                )
        for name, rows in self.focus_rows(case).items():
            self.score(
                name, case, self.recompute(case, rows), float(rows.sum()) / context_rows(case)
            )

    def hybrid(self, case: Case, layers: torch.Tensor, tokens: list[torch.Tensor]) -> PrefillResult:
        """Naive reuse with full prefill's KV in the chosen layers and rows."""
        inputs = []
        spans = case.full.layout.chunk_spans
        for chunk, (start, end), rows in zip(case.base, spans, tokens):
            chosen = layers[:, None, None, None, None] & rows[None, None, None, :, None]
            kv = torch.where(
                chosen, case.full.cache.rows(start, end), case.naive.cache.rows(start, end)
            )
            source = ChunkKV(
                chunk.token_ids,
                kv,
                start,
                self.engine.fingerprint,
                self.engine.prompts.prefix_digest,
            )
            inputs.append(ChunkInput(chunk.chunk_id, chunk.token_ids, source))
        return self.prefill(inputs, case.question, "naive")

    def focus_rows(self, case: Case) -> dict[str, torch.Tensor]:
        """The shipped probe's picks (engine/planners/focus.py) at several budgets, and the
        answer's chunk (oracle); records whether the probe ranks the answer's chunk first."""
        request = case.request
        with torch.inference_mode():
            peak = question_peak(self.engine.runner, request, self.probe_layer)
        first = ranked_chunks(peak, request)[0]
        self.rows.setdefault("probe's top chunk is the answer's", []).append(
            (first == case.answer, 0.0)
        )
        oracle = torch.zeros_like(peak, dtype=torch.bool)
        start, end = request.layout.chunk_spans[case.answer]
        oracle[start:end] = True
        return {
            "focus: top chunk": top_focus(peak, request, 1, 0.0),
            "focus: top 2 chunks": top_focus(peak, request, 2, 0.0),
            "focus: top rows 0.10": top_focus(peak, request, 0, 0.10),
            "focus: top rows 0.20": top_focus(peak, request, 0, 0.20),
            "focus: top rows 0.30": top_focus(peak, request, 0, 0.30),
            "focus: top chunk + top rows 0.10": top_focus(peak, request, 1, 0.10),
            "oracle: the answer's chunk": oracle & request.context_mask(),
        }

    def recompute(self, case: Case, rows: torch.Tensor) -> PrefillResult:
        """`rows` and the question computed from layer 0, every other context row reused."""
        request = case.request
        pinned = rows | request.question_mask()
        plan = Plan(request.all_cached_spans(), positions(pinned), pinned)
        layout = request.layout
        with torch.inference_mode():
            out = self.engine.runner.run(
                layout.token_tensor(), plan, capacity=layout.total_len + TOKENS
            )
        assert out.logits is not None
        return PrefillResult(
            Mode.named("naive"),
            layout,
            out.cache,
            out.logits,
            0.0,
            (),
            GuardReport(Fidelity.FAST),
            layers_computed=out.layers_computed,
        )


def context_rows(case: Case) -> int:
    return int(case.request.context_mask().sum())


def hybrids(case: Case, layers: int) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """{row: (layers taken from full [L], per chunk the rows taken from full)}."""
    lens = [end - start for start, end in case.full.layout.chunk_spans]
    every = torch.ones(layers, dtype=torch.bool)

    def per_chunk(pick: Callable[[int, int], bool]) -> list[torch.Tensor]:
        return [torch.full((n,), pick(i, n), dtype=torch.bool) for i, n in enumerate(lens)]

    answer = case.answer
    rows = {
        "naive (all reused)": (every, per_chunk(lambda i, n: False)),
        "full prefill's KV (check)": (every, per_chunk(lambda i, n: True)),
        "exact: the answer's chunk": (every, per_chunk(lambda i, n: i == answer)),
        "exact: the other chunks": (every, per_chunk(lambda i, n: i != answer)),
        "exact: chunks before the answer's": (every, per_chunk(lambda i, n: i < answer)),
        "exact: chunks after the answer's": (every, per_chunk(lambda i, n: i > answer)),
        "exact: first 8 rows of each chunk": (every, [torch.arange(n) < 8 for n in lens]),
    }
    quarter = layers // 4
    for part in range(4):
        chosen = torch.zeros(layers, dtype=torch.bool)
        chosen[part * quarter : (part + 1) * quarter] = True
        label = f"exact: layers {part * quarter}-{(part + 1) * quarter - 1} only"
        rows[label] = (chosen, per_chunk(lambda i, n: True))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--n", type=int, default=30, help="records full prefill answers right")
    parser.add_argument("--probe-layer", type=int, required=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    engine = Engine.load(EngineConfig(model=args.model, dtype="float32"))
    anatomy = Anatomy(engine, args.probe_layer)
    kept = seen = 0
    for index, record in enumerate(load_dataset(args.dataset)):
        if kept >= args.n:
            break
        seen += 1
        case = anatomy.case(record, index)
        if case is None:
            continue
        kept += 1
        anatomy.run_case(case)
        print(f"anatomy: {kept} kept of {seen} records", file=sys.stderr, flush=True)
    print(f"model {args.model}, {kept} records full prefill answers of the first {seen}")
    table = {}
    for name, outcomes in anatomy.rows.items():
        right = sum(ok for ok, _ in outcomes)
        share = sum(s for _, s in outcomes) / len(outcomes)
        table[name] = {
            "accuracy": right / len(outcomes),
            "right": right,
            "n": len(outcomes),
            "recomputed_share": share,
        }
        print(
            f"{name:44s} {right / len(outcomes):.3f} ({right}/{len(outcomes)})  "
            f"recomputed {share:.3f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "kept": kept, "seen": seen, "rows": table}, indent=2)
        )


if __name__ == "__main__":
    main()
