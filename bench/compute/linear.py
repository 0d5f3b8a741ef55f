"""`python -m bench.compute.linear`: the model's linear layers on torch's kernel and on oneDNN.

Times one product per shape that the engine runs, on the loaded model's own weights (so the
weights come from memory as in a real step, not from a cache warmed by a random matrix of
the same shape), with each kernel, alternating kernels per repeat so a busy machine slows
both alike; prints milliseconds (median) and the ratio. Shapes: a prefill's 2,048 and 512
rows through one layer's MLP up-projection, the 30 layers' q/k/v/o/MLP products for 1 and
4 rows (a lone and a batched decode step), and lm_head for 1 and 4 rows. Run it on a new
machine before trusting `KVMOSAIC_LINEAR_KERNEL=auto` there (engine/model/linear.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.model.linear import OneDnnLinear, onednn_agrees
from engine.model.loader import load_model
from engine.serving.threads import use_threads

Product = Callable[[], object]


def kernels(
    weights: list[torch.Tensor],
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Each kernel as f(x, weight), built once per weight for oneDNN (no bias: none in these
    models)."""
    onednn = {id(w): OneDnnLinear(_as_linear(w)) for w in weights}
    return {"torch": torch.nn.functional.linear, "onednn": lambda x, w: onednn[id(w)](x)}


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def cases(model: Any) -> dict[str, tuple[list[tuple[int, torch.Tensor]], int]]:
    """{label: ([(rows, weight), ...], repeats)}: the products each case runs once per repeat.

    `model`: a Llama-family causal LM (`model.layers[i].mlp.up_proj`, `lm_head`), duck-typed."""
    layers = model.model.layers
    per_layer = [
        m.weight
        for layer in layers
        for m in layer.modules()
        if isinstance(m, (torch.nn.Linear, OneDnnLinear))
    ]
    up = layers[0].mlp.up_proj.weight
    head = model.lm_head.weight
    return {
        "prefill, 2048 rows x up_proj": ([(2048, up)], 10),
        "prefill, 512 rows x up_proj": ([(512, up)], 20),
        "decode, 1 row x every layer's q/k/v/o/MLP": ([(1, w) for w in per_layer], 10),
        "decode, 4 rows x every layer's q/k/v/o/MLP": ([(4, w) for w in per_layer], 10),
        "decode, 1 row x lm_head": ([(1, head)], 20),
        "decode, 4 rows x lm_head": ([(4, head)], 20),
    }


def time_case(
    products: list[tuple[int, torch.Tensor]],
    repeats: int,
    run: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
) -> dict[str, float]:
    """Median milliseconds per kernel for running every product once."""
    inputs = {
        (rows, w.shape[1]): torch.randn(rows, w.shape[1], dtype=w.dtype) for rows, w in products
    }
    times: dict[str, list[float]] = {name: [] for name in run}
    for repeat in range(repeats + 1):
        for name, linear in run.items():
            started = time.perf_counter()
            for rows, weight in products:
                linear(inputs[rows, weight.shape[1]], weight)
            if repeat:  # the first round warms up
                times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--dtype", default="auto", help="auto (float32 on the CPU) or bfloat16")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        use_threads(args.threads)
    loaded = load_model(args.data_dir, None, "cpu", args.dtype, linear_kernel="torch")
    if not onednn_agrees(loaded.dtype):
        raise SystemExit(f"this PyTorch build has no usable oneDNN linear for {loaded.dtype}")
    table = cases(loaded.model)
    run = kernels([w for products, _ in table.values() for _, w in products])
    print(
        f"{'':46} {'torch ms':>9} {'onednn ms':>9} {'torch/onednn':>12}   ({loaded.dtype}, "
        f"{torch.get_num_threads()} threads)"
    )
    with torch.inference_mode():
        for label, (products, repeats) in table.items():
            ms = time_case(products, repeats, run)
            print(
                f"{label:46} {ms['torch']:9.2f} {ms['onednn']:9.2f} "
                f"{ms['torch'] / ms['onednn']:11.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
