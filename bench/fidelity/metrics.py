"""Fidelity and quality metrics: KL, top-1 agreement, ROUGE-L, token F1, and teacher-forced
answer fidelity (a reference answer fed to a mode over its own cache).

Everything here measures; nothing changes how a mode answers."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.engine import Engine
from engine.model.attention import QueryLayout
from engine.result import PrefillResult
from engine.serving.guard import first_repair, first_token_margin


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) between the softmax distributions, in nats."""
    p = torch.log_softmax(reference_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def same_top1(reference_logits: torch.Tensor, logits: torch.Tensor) -> bool:
    return int(reference_logits.argmax()) == int(logits.argmax())


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if not pred or not ref:
        return float(pred == ref)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, golds: list[str]) -> float:
    return max((token_f1(prediction, g) for g in golds), default=0.0)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure over normalised words (longest common subsequence)."""
    cand, ref = normalize_answer(candidate).split(), normalize_answer(reference).split()
    if not cand or not ref:
        return float(cand == ref)
    lcs = _lcs_length(cand, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


class TeacherForced(NamedTuple):
    """How a mode follows a reference answer fed to it token by token (teacher forcing).

    positions: answer positions compared; top1_share: share of them where the mode's top-1
    token equals the reference token; mean_kl: mean KL(reference ‖ mode) per position, in nats.
    """

    positions: int
    top1_share: float
    mean_kl: float


def teacher_forced(
    engine: Engine,
    result: PrefillResult,
    reference_ids: Sequence[int],
    reference_logits: torch.Tensor | None = None,
) -> TeacherForced:
    """Feed `reference_ids` (full's greedy answer) to the mode over its own prefill cache.

    Position i compares the mode's next-token distribution after answer tokens [0, i) with
    the reference: position 0 is the prefill's first-token logits. `reference_logits`
    [len(reference_ids), vocab] (from `forced_logits` over full's result) gives the KL; without
    it mean_kl is NaN and only top-1 against `reference_ids` counts. Overwrites the result's
    cache rows after the prompt (call it after decoding, or on a result never decoded); an
    empty reference compares nothing (positions 0, shares NaN).
    """
    ids = list(reference_ids)
    if not ids:
        return TeacherForced(0, float("nan"), float("nan"))
    logits = forced_logits(engine, result, ids)
    if reference_logits is not None:
        logits = guarded_logits(result, logits, reference_logits)
    top1 = float((logits.argmax(-1).cpu() == torch.tensor(ids)).double().mean())
    if reference_logits is None:
        return TeacherForced(len(ids), top1, float("nan"))
    if reference_logits.shape != logits.shape:
        raise ValueError(
            f"reference_logits {tuple(reference_logits.shape)} do not match {tuple(logits.shape)}"
        )
    kls = [kl_divergence(ref, own) for ref, own in zip(reference_logits, logits)]
    return TeacherForced(len(ids), top1, sum(kls) / len(kls))


def guarded_logits(
    result: PrefillResult, logits: torch.Tensor, reference_logits: torch.Tensor
) -> torch.Tensor:
    """The forced `logits` as the fidelity guard would leave them: from the first position
    where the result's answer watch fires (engine.serving.guard.AnswerWatch) on the mode's own
    logits, decoding goes on from the reference state, so those rows are the reference's
    (its repair is a reference prefill of the same prompt and answer tokens)."""
    if result.watch is None or reference_logits.shape != logits.shape:
        return logits
    fired = first_repair([first_token_margin(row) for row in logits], result.watch)
    if fired is None:
        return logits
    return torch.cat([logits[:fired], reference_logits[fired:].to(logits.dtype)])


def forced_logits(engine: Engine, result: PrefillResult, ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] float32 (CPU) predicting ids[i] after the prompt and ids[:i].

    Row 0 is the prefill's first-token logits; rows 1.. come from one pass of ids[:-1] at
    positions prompt_len.. through every layer, attending to the cache the mode's prefill
    produced (`result.cache`, which a guard repair leaves as it was; written in place: those
    rows of the cache are the teacher's tokens afterwards), read as its decode reads it
    (`KVCache.reading`). The pass runs on the engine's
    compute thread (`Engine.compute`), like the requests' own work.
    """
    return engine.compute(lambda: _forced_logits(engine, result, ids))


def _forced_logits(engine: Engine, result: PrefillResult, ids: Sequence[int]) -> torch.Tensor:
    stack, start = engine.stack, result.layout.total_len
    cache = result.cache
    fed = list(ids)[:-1]
    if start + len(fed) > cache.capacity:
        raise ValueError(f"{len(fed)} forced tokens do not fit in a cache of {cache.capacity} rows")
    rows = [result.logits.float().cpu()[None]]
    if fed:
        device = cache.data.device
        positions = torch.arange(start, start + len(fed), device=device)
        hidden = stack.embed(torch.tensor(fed, device=device))
        end = start + len(fed)
        queries = QueryLayout(positions, end, hidden.dtype)
        cos, sin = stack.rope_tables(positions, hidden)
        for layer in range(stack.spec.num_layers):
            x = stack.input_norm(layer, hidden)
            k, v = stack.project_kv(layer, x, cos, sin)
            cache.data[layer, 0, :, start:end] = k
            cache.data[layer, 1, :, start:end] = v
            q = stack.project_q(layer, x, cos, sin)
            hidden = stack.attend_and_mlp(
                layer,
                hidden,
                q,
                cache.keys(layer, end),
                cache.values(layer, end),
                queries,
                reading=cache.reading,  # a row read by APE: its answer too (engine/ape.py)
            )
        rows.append(stack.logits(hidden).cpu())
    return torch.cat(rows)
