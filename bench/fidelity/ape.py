"""APE's attention knobs (arXiv 2502.05431) on reused chunks, screened on the Hugging Face path.

APE encodes every context alone after a shared prefix (as our base variants are, after the
system prefix) and changes how the rows after the contexts read them: a row's attention logits
on context keys are divided by a temperature T, and the contexts' total attention is scaled by
S; prefix and question keys are read as usual. Per query row and head, with l the scaled logits,

    lse_P = logsumexp(l_P),  lse_C = T · logsumexp(l_C / T) + log S,  lse_Q = logsumexp(l_Q)

and the output is softmax([lse_P, lse_C, lse_Q]) over the three segments' own softmax-weighted
values (l_C / T inside the contexts'). T = S = 1 is plain attention. APE places contexts in
parallel (all at the prefix's end); here they keep the serving layout's sequential positions,
as every reuse mode of the engine does.

    python -m bench.fidelity.ape --model qwen2.5-coder-0.5b --seed 9 --n 40 \\
        --knobs 0.9:0.9,0.8:0.8

This is a research screen, not a mode: `reading_with(knobs, start, end)` switches the model's
attention to APE's for the rows read inside it (the question and the answer); chunk encoding
outside it runs the model's own attention.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from bench.fidelity.adapt import distiller_of
from bench.fidelity.cases import TUNING_SEEDS, generate_cases
from bench.fidelity.reading import Reader, judge
from engine.adapt.packets import reused_cache
from engine.adapt.train import Distiller, Example
from engine.config import EngineConfig
from engine.engine import Engine

IMPLEMENTATION = "kvmosaic_ape"


@dataclass(frozen=True)
class Knobs:
    """APE's temperature on context logits and scale on the contexts' total attention."""

    temperature: float
    scale: float

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.scale <= 0:
            raise ValueError(f"APE's knobs must be positive, got {self}")

    @property
    def label(self) -> str:
        return f"ape[T={self.temperature:g};S={self.scale:g}]"

    @classmethod
    def parse(cls, text: str) -> Knobs:
        """`T:S`, e.g. `0.9:0.9`."""
        temperature, _, scale = text.partition(":")
        return cls(float(temperature), float(scale or temperature))


_READING: ContextVar[tuple[Knobs, int, int] | None] = ContextVar("ape_reading", default=None)


@contextmanager
def reading_with(knobs: Knobs, start: int, end: int) -> Iterator[None]:
    """Rows computed inside read keys [start, end) (the contexts) by APE's attention."""
    token = _READING.set((knobs, start, end))
    try:
        yield
    finally:
        _READING.reset(token)


def use_ape(model: PreTrainedModel) -> None:
    """Route `model`'s attention through `ape_attention` (plain attention outside
    `reading_with`)."""
    AttentionInterface.register(IMPLEMENTATION, ape_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)


def ape_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface of transformers: query [b, heads, q, d], key / value
    [b, kv_heads, k, d] (the last q keys are the query rows' own); returns [b, q, heads, d]."""
    reading = _READING.get()
    if reading is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    knobs, start, end = reading
    groups = int(getattr(module, "num_key_value_groups", 1))
    keys, values = repeat_kv(key, groups).float(), repeat_kv(value, groups).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = query.float() @ keys.transpose(2, 3) * scale
    rows, length = logits.shape[-2:]
    if start >= end or end > length - rows:
        raise ValueError(f"APE reads contexts [{start}, {end}) before the rows it computes")
    late = torch.arange(length)[None, :] > torch.arange(rows)[:, None] + (length - rows)
    logits = logits.masked_fill(late, -math.inf)  # causal among the rows computed together
    segments = (
        (logits[..., :start], values[:, :, :start], 1.0, 0.0),
        (logits[..., start:end], values[:, :, start:end], knobs.temperature, math.log(knobs.scale)),
        (logits[..., end:], values[:, :, end:], 1.0, 0.0),
    )
    masses, outputs = [], []
    for part, rows_v, temperature, bias in segments:
        scaled = part / temperature
        masses.append(torch.logsumexp(scaled, -1) * temperature + bias)
        outputs.append(torch.softmax(scaled, -1).nan_to_num() @ rows_v)
    weights = torch.softmax(torch.stack(masses), 0)  # [3, b, heads, q]
    out = sum(w[..., None] * o for w, o in zip(weights, outputs))
    assert isinstance(out, torch.Tensor)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def ape_reader(distiller: Distiller, knobs: Knobs, max_new_tokens: int) -> Reader:
    """A row that reads each chunk's base, moved to its place, by APE's attention."""

    def read(example: Example) -> tuple[int, ...]:
        with torch.no_grad():
            cache, position = reused_cache(
                distiller.model, distiller.prefix, example.chunks, None, distiller.inv_freq
            )
        with reading_with(knobs, distiller.start, position):
            return distiller.greedy(cache, position, example.question_ids, max_new_tokens)[0]

    return read


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=9, help="a tuning seed (0-999)")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--knobs", default="0.9:0.9", help="T:S pairs, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: the engine's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seed not in TUNING_SEEDS:
        parser.error(f"tune APE's knobs on a tuning seed ({TUNING_SEEDS})")
    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, linear_kernel="torch"
    )
    engine = Engine.load(config)  # the same path as the packets' judge (bench.fidelity.packets)
    distiller = distiller_of(engine)
    use_ape(distiller.model)
    readers: dict[str, Reader] = {
        "naive": lambda e: distiller.reused_answer(e, None, args.max_new_tokens)
    }
    for text in args.knobs.split(","):
        knobs = Knobs.parse(text.strip())
        readers[knobs.label] = ape_reader(distiller, knobs, args.max_new_tokens)
    cases = generate_cases(args.seed, args.n)
    rows = judge(engine, distiller, cases, readers, args.seed, args.max_new_tokens, "naive")
    summary = {"model": args.model, "seed": args.seed, "n": args.n, "rows": rows}
    summary["dtype"] = str(engine.loaded.dtype)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
