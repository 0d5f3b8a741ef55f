"""Time between streamed pieces of one answer through `Engine.generate`, full prefill of a
~2,200-token prompt: the decode a user sees, on any tree with the engine's public API.

    python -m bench.compute.stream_gap                       # this tree
    PYTHONPATH=<other tree> python bench/compute/stream_gap.py   # an older one (103c3ce on)

Prints each answer's median gap and the median of the answers' medians (docs/benchmarks/decode.md).
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig
from engine.engine import Engine
from engine.plan import ChunkInput


def _tree_names() -> tuple[Any, Any]:
    """(SamplingParams, the full mode) in the tree's own names: engine/model/ and typed modes
    (#49), or the flat engine before them; looked up by name, so any tree type-checks alike."""
    try:
        decode = importlib.import_module("engine.model.decode")
        full: Any = importlib.import_module("engine.planners").Mode.named("full")
    except ImportError:
        decode, full = importlib.import_module("engine.decode"), "full"
    return decode.SamplingParams, full


REPO = Path(__file__).resolve().parents[2]
ANSWERS, PIECES, PARTS, WORDS = 3, 96, 6, 180


def main() -> None:
    torch.set_num_threads(2)
    sampling, full = _tree_names()
    data_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "data"
    settings: dict[str, Any] = dict(data_dir=data_dir, dtype="float32", fidelity="fast")
    engine = Engine.load(EngineConfig(**settings))
    words = (REPO / "docs" / "architecture.md").read_text().split()
    chunks = [
        ChunkInput(
            i + 1, engine.chunk_ids(" ".join(words[i * WORDS : (i + 1) * WORDS]), f"Part {i}")
        )
        for i in range(PARTS)
    ]
    medians = []
    for answer in range(ANSWERS):
        result = engine.prefill(
            chunks, "Copy out Part 0 word for word, then Part 1.", full, max_new_tokens=PIECES
        )
        stamps = [
            time.perf_counter() for _ in engine.generate(result, sampling(max_new_tokens=PIECES))
        ]
        medians.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
        print(
            f"answer {answer}: prompt {result.layout.total_len} tokens, {len(stamps)} pieces, "
            f"median gap {1000 * medians[-1]:.1f} ms",
            flush=True,
        )
    print(json.dumps({"median_ms_per_piece": 1000 * statistics.median(medians)}))


if __name__ == "__main__":
    main()
