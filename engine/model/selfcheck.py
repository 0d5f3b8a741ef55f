"""Start-up self-checks: does shifting cached K by a delta equal fresh RoPE at the new place,
and do the prompt's pieces tokenize alone as the whole prompt does?

Layer-0 K depends only on the token and its position, so it isolates RoPE: compute K at
positions base..base+n-1, shift it by several deltas (forward, backward, far), and compare
with K computed fresh at the shifted positions. Rope types whose rotation does not compose
(dynamic NTK scaling past its original length, some long-context schemes) fail here, and
reuse is then refused; engine/model/families.py refuses the known ones at load already.

The tokenization check only reports: every mode runs on the same pieces' ids, so a boundary
that tokenizes differently alone changes no comparison, but the prompt is then not the
tokenization of its own text, and the engine says at which boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import ops
from engine.model.layers import DecoderStack
from engine.prompt import PromptBuilder

# Relative max error allowed (float32 / half precision). Fresh float32 RoPE itself carries
# ~1e-4 relative angle error at 8k positions; the shift must stay within a few times that.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class SelfCheckResult:
    ok: bool
    max_error: float
    message: str


def rope_shift_selfcheck(stack: DecoderStack, num_tokens: int = 32) -> SelfCheckResult:
    spec = stack.spec
    device = stack.embed_tokens.weight.device
    dtype = stack.embed_tokens.weight.dtype
    ids = torch.arange(num_tokens, device=device) % spec.vocab_size
    base = 7
    last_start = spec.max_positions - num_tokens
    deltas = [1, 37, 1000 - base, last_start - base, -base]
    worst = 0.0
    with torch.inference_mode():
        original = _layer0_keys(stack, ids, base)
        for delta in deltas:
            if not 0 <= base + delta <= last_start:
                continue
            shifted = ops.rope_shift_(original.clone(), delta, stack.inv_freq)
            fresh = _layer0_keys(stack, ids, base + delta)
            scale = fresh.float().abs().max().clamp_min(1e-6)
            error = float((shifted.float() - fresh.float()).abs().max() / scale)
            worst = max(worst, error)
    tolerance = TOLERANCE.get(dtype, 5e-2)
    if worst <= tolerance:
        return SelfCheckResult(
            True, worst, f"RoPE shift self-check passed (max relative error {worst:.2e})"
        )
    return SelfCheckResult(
        False,
        worst,
        (
            f"RoPE shift self-check failed: shifted keys differ from fresh ones by {worst:.2e} "
            f"(tolerance {tolerance:.0e}); this model's rope type does not compose, so KV reuse "
            f"is off"
        ),
    )


# Two passages and a question of the kind requests carry: titles, digits, punctuation.
SAMPLE_CHUNKS = [
    ("Ada", "Ada Lovelace wrote the first published algorithm in 1843."),
    ("Rivers", "The Danube flows through ten countries; it reaches the Black Sea."),
]
SAMPLE_QUESTION = "Who wrote the first algorithm?"


def tokenization_selfcheck(prompts: PromptBuilder) -> SelfCheckResult:
    """Whether [prefix][chunks][question] tokenized piece by piece equals the whole text
    tokenized at once (max_error: 0 or 1); the message names the first boundary that differs."""
    check = prompts.boundaries(SAMPLE_CHUNKS, SAMPLE_QUESTION)
    if check.ok:
        return SelfCheckResult(
            True,
            0.0,
            "tokenization self-check passed: the prompt's pieces "
            "tokenize alone as the whole prompt does",
        )
    return SelfCheckResult(
        False,
        1.0,
        (
            f"tokenization self-check: at the boundary {check.boundary} the pieces tokenized alone "
            f"give {list(check.alone)} where the whole prompt gives {list(check.together)}; every "
            f"mode runs on the pieces' ids, so modes stay comparable, but the prompt is not the "
            f"tokenization of its text there (docs/models.md, chat templates)"
        ),
    )


def _layer0_keys(stack: DecoderStack, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.numel(), device=ids.device)
    x = stack.input_norm(0, stack.embed(ids))
    cos, sin = stack.rope_tables(positions, x)
    k, _ = stack.project_kv(0, x, cos, sin)
    return k
