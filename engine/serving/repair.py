"""The guard's repair while decoding, as a record, and the answer stream that carries it.

A blended decode that the guard stops (engine/serving/guarded.py) goes on from an exact prefill
of the prompt and the answer so far; the `Repair` says where, why and at what cost, and travels
in the answer's own stream (`AnswerIds`) so that whoever reads the stream learns of it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from engine.kv import KVCache
from engine.serving.guard import RepairReason


@dataclass(frozen=True)
class Repair:
    """The guard's repair while decoding: the blended decode stopped before answer token `at`,
    because a top-token margin `margin` nats was below the threshold (`reason` "margin"; at that
    token, or a later one while the grounding check held back `span` from `at` on) or because
    the answer's `span` from token `at` on is a number, date or name that no passage nor the
    question contains (`reason` "grounding", `margin` None); the prompt and
    the answer before `at` were prefilled as the reference would (`seconds`, after TTFT;
    `layers_computed`: [rows] layers per row) into `cache`, and decoding went on from there."""

    at: int
    margin: float | None
    seconds: float
    cache: KVCache
    layers_computed: torch.Tensor
    reason: RepairReason = "margin"
    span: str | None = None


# An answer's stream: its token ids, and the guard's `Repair` at the point where it was made
# (at most one), so a stream closed after its repair still says what answered.
AnswerIds = Generator[int | Repair, None, None]
