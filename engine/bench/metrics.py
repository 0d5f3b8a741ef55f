"""Fidelity and quality metrics: KL, top-1 agreement, ROUGE-L and token F1."""

from __future__ import annotations

import re
import string
from collections import Counter

import torch


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
