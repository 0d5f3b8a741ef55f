"""`python -m bench.compute.batching`: decode throughput with continuous batching on and off.

`concurrency` requests (each a prefill of a few passages and a question, then `max_tokens`
greedy tokens) run at once from their own threads, as the server's workers run them, through
two engines on the same loaded model: one with batching (every decode step shared) and one
without (each request decodes alone on its thread). Rounds alternate between the two, so a
busy machine slows both alike; the figures are ratios measured in the same run:

- decode tokens/s: tokens generated after the first (which comes from the prefill), over the
  wall time from the start of decoding to the last request's end; all requests start
  decoding together, after every prefill, so the figure is decode alone;
- decode tokens per CPU second: the same tokens over the process's CPU time while decoding
  (on a machine shared with other work, wall time follows the share of the cores a process
  gets, which grows with its number of busy threads; CPU time measures the work itself);
- TTFT: each request's prefill, all started at once, waits included (with batching,
  prefills take turns);
- the answers themselves, which must be the same both ways (greedy).

Prompts: by default a few short built-in passages (caches of ~150 tokens, where a step is
mostly its linear layers); with `--dataset` (a benchmark JSON such as MuSiQue), request i asks
record `--start` + i's question over its first `--chunks` passages, RAG-sized caches (~1,500-
2,500 tokens), where each row's attention over its own cache is a large part of a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

import torch

from bench.fidelity.fidelity import Record, base_variant_chunks, load_dataset
from engine.config import EngineConfig, Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.serving.threads import in_own_thread

PASSAGES = [
    "The Saltcote tide mill was built in 1794 and ground grain with the ebb tide for a century.",
    "Honey bees tell their sisters where flowers are with a waggle dance on the comb.",
    "The Long Arm breakwater shelters the harbour of Port Ellery from the winter storms.",
    "Glaciers move because ice deforms under its own weight and slides on meltwater.",
    "Lichens are partnerships of a fungus with algae or cyanobacteria that photosynthesise.",
    "The printing press with movable type spread across Europe within fifty years of 1450.",
]
QUESTIONS = [
    "When was the tide mill built?",
    "How do bees show where flowers are?",
    "What does the breakwater shelter?",
    "Why do glaciers move?",
    "What is a lichen?",
    "When did printing spread?",
    "What grinds the grain?",
    "What protects the harbour?",
]


@dataclass
class Round:
    """One round of `concurrency` requests through one engine."""

    decode_tokens: int
    decode_wall_s: float
    decode_cpu_s: float
    ttft_s: list[float]
    answers: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_wall_s


Prompt = tuple[list[ChunkInput], str]  # a request's chunks (with their base KV) and question


def builtin_prompts(engine: Engine, count: int) -> list[Prompt]:
    """`count` prompts over the built-in passages, each in its own rotation, with a question
    each."""
    chunks = [
        ChunkInput(i, ids, engine.encode_chunk(ids))
        for i, ids in enumerate(engine.chunk_ids(text) for text in PASSAGES)
    ]
    return [
        (chunks[i % len(chunks) :] + chunks[: i % len(chunks)], QUESTIONS[i % len(QUESTIONS)])
        for i in range(count)
    ]


def dataset_prompts(
    engine: Engine, records: Sequence[Record], start: int, count: int, chunks: int
) -> list[Prompt]:
    """Records start .. start + count - 1: each one's question over its first `chunks` passages."""
    if start < 0 or start + count > len(records):
        raise InvalidRequest(
            f"records {start}..{start + count - 1} asked of a dataset of {len(records)}"
        )
    return [
        (base_variant_chunks(engine, records[i], chunks, i), records[i]["question"])
        for i in range(start, start + count)
    ]


def run_round(
    engine: Engine, prompts: Sequence[Prompt], concurrency: int, max_tokens: int, mode: Mode
) -> Round:
    """`concurrency` requests at once, each on its own thread, request i with prompt i modulo
    their number; see the module docstring."""
    ttft = [0.0] * concurrency
    answers: list[list[int]] = [[] for _ in range(concurrency)]
    first_step: list[float] = []
    ends: list[float] = []
    cpu: list[float] = []
    prefill_start, decode_start = threading.Barrier(concurrency), threading.Barrier(concurrency)

    def request(i: int) -> None:
        prefill_start.wait()
        started = time.perf_counter()
        chunks, question = prompts[i % len(prompts)]
        result = engine.prefill(chunks, question, mode, max_new_tokens=max_tokens)
        ttft[i] = time.perf_counter() - started
        decode_start.wait()
        first_step.append(time.perf_counter())
        cpu.append(time.process_time())
        _, decoded = read_out(engine.generate(result, SamplingParams(max_new_tokens=max_tokens)))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
        answers[i] = list(decoded.token_ids)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = sum(max(len(a) - 1, 0) for a in answers)  # the first token comes from the prefill
    return Round(tokens, max(ends) - min(first_step), max(cpu) - min(cpu), ttft, answers)


def measure(
    engine_on: Engine,
    engine_off: Engine,
    prompts: Sequence[Prompt],
    concurrency: int,
    max_tokens: int,
    mode: Mode,
    rounds: int,
) -> Figures:
    """Alternate rounds off / on; return the figures of both and their ratios."""
    results: dict[str, list[Round]] = {"off": [], "on": []}
    run_round(engine_on, prompts, concurrency, 4, mode)  # warm-up: threads, allocator
    for _ in range(rounds):
        for label, engine in (("off", engine_off), ("on", engine_on)):
            results[label].append(run_round(engine, prompts, concurrency, max_tokens, mode))
    on, off = _summary(results["on"]), _summary(results["off"])
    return {
        "off": off,
        "on": on,
        "decode_speedup": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
        "decode_cpu_speedup": on["decode_tokens_per_cpu_s"] / off["decode_tokens_per_cpu_s"],
        "ttft_p95_ratio": on["ttft_p95_s"] / off["ttft_p95_s"],
        "same_answers": all(a.answers == b.answers for a, b in zip(results["on"], results["off"])),
    }


class Summary(TypedDict):
    """One setting's rounds: decode throughput by wall and CPU time, TTFT, tokens decoded."""

    decode_tokens_per_s: float
    decode_tokens_per_cpu_s: float
    ttft_median_s: float
    ttft_p95_s: float
    decode_tokens: int


class Figures(TypedDict):
    """Batching off and on, and on's ratios over off."""

    off: Summary
    on: Summary
    decode_speedup: float
    decode_cpu_speedup: float
    ttft_p95_ratio: float
    same_answers: bool


def _summary(rounds: list[Round]) -> Summary:
    ttfts = sorted(t for r in rounds for t in r.ttft_s)
    return {
        "decode_tokens_per_s": sum(r.decode_tokens for r in rounds)
        / sum(r.decode_wall_s for r in rounds),
        "decode_tokens_per_cpu_s": sum(r.decode_tokens for r in rounds)
        / sum(r.decode_cpu_s for r in rounds),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "decode_tokens": sum(r.decode_tokens for r in rounds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--mode", default="cacheblend")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--max-batch", type=int, default=EngineConfig.max_batch)
    parser.add_argument(
        "--dtype", default=EngineConfig.dtype, help="auto, float32, bfloat16 or float16"
    )
    parser.add_argument(
        "--decode-attention", default=EngineConfig.decode_attention, help="auto, native or torch"
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="benchmark JSON (e.g. MuSiQue): RAG-sized prompts from its records instead of the "
        "built-in ones",
    )
    parser.add_argument("--start", type=int, default=0, help="first record of --dataset")
    parser.add_argument("--chunks", type=int, default=6, help="passages per prompt from --dataset")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_on = Engine.load(
        EngineConfig(
            data_dir=args.data_dir,
            fidelity=Fidelity.FAST,
            max_batch=args.max_batch,
            dtype=args.dtype,
            decode_attention=args.decode_attention,
        )
    )
    # Built on a passing thread, as Engine.load is: this thread keeps no OpenMP pool that would
    # slow the batching engine's compute thread (engine/serving/threads.py).
    engine_off = in_own_thread(
        lambda: Engine(replace(engine_on.config, batching=False), engine_on.model_loaded)
    )
    prompts = (
        dataset_prompts(
            engine_on, load_dataset(args.dataset), args.start, args.concurrency, args.chunks
        )
        if args.dataset
        else builtin_prompts(engine_on, args.concurrency)
    )
    tokens = [sum(len(c.token_ids) for c in chunks) for chunks, _ in prompts]
    print(f"{len(prompts)} prompts of {min(tokens)}-{max(tokens)} context tokens")
    figures = measure(
        engine_on,
        engine_off,
        prompts,
        args.concurrency,
        args.max_tokens,
        Mode.named(args.mode),
        args.rounds,
    )
    for label, f in (("off", figures["off"]), ("on", figures["on"])):
        print(
            f"batching {label:3}: decode {f['decode_tokens_per_s']:6.1f} tokens/s "
            f"{f['decode_tokens_per_cpu_s']:6.1f} tokens/CPU-s  TTFT median "
            f"{f['ttft_median_s'] * 1000:7.0f} ms  p95 {f['ttft_p95_s'] * 1000:7.0f} ms  "
            f"({f['decode_tokens']} tokens)"
        )
    print(
        f"decode on/off: {figures['decode_speedup']:.2f}x tokens/s, "
        f"{figures['decode_cpu_speedup']:.2f}x tokens/CPU-s"
        f"   TTFT p95 on/off: "
        f"{figures['ttft_p95_ratio']:.2f}x   same answers: {figures['same_answers']}"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **figures}, indent=2)
        )
    engine_on.close()


if __name__ == "__main__":
    main()
