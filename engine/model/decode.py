"""Decode: generate tokens from an assembled cache, greedy or sampled, as a stream.

One token per step: its row runs through every layer, its K/V are appended to the cache, and
its query attends to all earlier rows. Generation stops at an EOS token or the token budget.
A step runs on the stack's native step where it can (engine/model/native_step.py: the whole
step in one C call), else on its twin here (the model's modules, one operation at a time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

import torch

from engine.cpu.library import CpuKernelError
from engine.errors import InvalidRequest
from engine.kv import KVCache
from engine.model.decode_attention import ReadingStepAttention, step_attention
from engine.model.decode_weights import needs_native_step
from engine.model.layers import DecoderStack
from engine.model.linear import OneDnnLinear
from engine.model.native_step import NativeDecodeStep, build_native_step

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p in (0, 1] keeps the smallest nucleus of that mass."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 5.0:
            raise InvalidRequest("temperature must lie in [0, 5]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must lie in (0, 1]")


@dataclass(frozen=True)
class Fired:
    """A `StepCheck`'s verdict: it stopped the decode before step `at`'s token was picked, the
    top-token margin there being `margin` nats. Immutable: made on the thread that decodes and
    handed to the stream's reader by the stream's end (`ended_by`), never shared while it runs."""

    at: int
    margin: float


class StepCheck(Protocol):
    """Looks at a step's logits before its token is picked (the fidelity guard's `AnswerWatch`);
    `fired(step, logits)` returns a `Fired` to stop decoding there (nothing picked), else None.
    It keeps no state, so any thread may call it."""

    def fired(self, step: int, logits: torch.Tensor) -> Fired | None: ...


def generate_ids(
    stack: DecoderStack,
    cache: KVCache,
    first_logits: torch.Tensor,
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    check: StepCheck | None = None,
    generator: torch.Generator | None = None,
) -> Generator[int, None, Fired | None]:
    """Yield generated token ids; the EOS token that ends generation is not yielded. Returns
    `check`'s verdict when it stopped the decode (None: it ended otherwise).

    Appends to `cache` in place; stops early if the cache is full, or before picking a step's
    token when `check` fires on its logits. `generator` (None: a new one from params.seed)
    lets a decode that resumes elsewhere draw the same random numbers as one that did not.
    """
    generator = new_generator(params.seed, first_logits.device) if generator is None else generator
    logits = first_logits
    for step in range(params.max_new_tokens):
        fired = check.fired(step, logits) if check is not None else None
        if fired is not None:
            return fired
        token = pick_token(logits, params, generator)
        if token in eos_ids:
            return None
        yield token
        if step + 1 == params.max_new_tokens or cache.length >= cache.capacity:
            return None
        logits = decode_step(stack, cache, token)
    return None


@torch.inference_mode()
def decode_step(stack: DecoderStack, cache: KVCache, token: int) -> torch.Tensor:
    """Run one token at position cache.length through all layers; return its logits [vocab].

    A batch of one (`decode_batch`): the same code, so a lone request's tokens are those it gets
    in any batch (bit for bit on the native step; on the twin, unpadded, to rounding)."""
    return decode_batch(stack, [cache], [token])[0]


# The twin's batched step (`twin_batch`) runs its linear layers on a multiple of
# `row_multiple(stack)` rows (padding the rest), so that a row's result does not depend on how
# many rows share the product (the native step needs none of this: its products give a row the
# same bits in any batch by construction). Which row counts round alike depends on the CPU, the
# BLAS and the weight shapes: with MKL on AVX2 every multiple of 4 did; on an AVX-512 Xeon
# (SmolLM2's 576x1536 MLP) 2-15 rows share one kernel and 16 or more another. So the multiple
# is measured once per model, machine and largest batch: the smallest of ROW_MULTIPLES for
# which every multiple that a batch of up to `max_rows` requests pads to gives bit-identical
# rows in every linear layer's shape (measured for SmolLM2 on that AVX-512 Xeon: 4 for batches
# of up to 8; on an AVX-512 EPYC: 4 in float32, 2 in bfloat16, whose kernels round the rows of
# an odd count's remainder differently from the same row alone).
ROW_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX_ROWS = 8  # the scheduler's default max_batch


def row_multiple(stack: DecoderStack, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """The row multiple that batched steps of at most `max_rows` requests of this model pad to
    (measured on first use, cached per stack and max_rows: a few small matrix products)."""
    cache: dict[int, int] = stack.__dict__.setdefault("_row_multiples", {})
    if max_rows not in cache:
        cache[max_rows] = _measure_row_multiple(stack, max_rows)
    return cache[max_rows]


@torch.inference_mode()
def _measure_row_multiple(stack: DecoderStack, max_rows: int) -> int:
    # The layers' own modules, so the probe runs the kernel the model runs (engine/model/linear.py).
    modules = [
        m
        for part in (stack.layers[0], stack.lm_head)
        if isinstance(part, torch.nn.Module)
        for m in part.modules()
        if isinstance(m, (torch.nn.Linear, OneDnnLinear))
    ]
    linears = {tuple(m.weight.shape): m for m in modules}
    generator = torch.Generator().manual_seed(0)
    for multiple in ROW_MULTIPLES:
        padded = -(-max_rows // multiple) * multiple  # the most rows a batch of max_rows pads to
        probes = [
            (m, torch.randn(padded, m.weight.shape[1], generator=generator).to(m.weight))
            for m in linears.values()
        ]
        if all(_rows_agree(m, x, multiple) for m, x in probes):
            return multiple
    return -(-max_rows // ROW_MULTIPLES[-1]) * ROW_MULTIPLES[-1]


def _rows_agree(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, multiple: int
) -> bool:
    """Whether every row of linear(x), for every row count that is a multiple of `multiple`
    up to x's rows, is bit-identical to that row computed alone in a block of `multiple` rows
    (as the invariant lone step pads it). Every row is checked, not only the first block:
    kernels may treat the rows of a remainder block differently (bfloat16 on an AVX-512 EPYC
    agreed on row 0 at every count but not on the last rows of 3, 5 or 6)."""
    lone = [linear(torch.cat([x[i : i + 1], x[: multiple - 1]]))[0] for i in range(x.shape[0])]
    for rows in range(multiple, x.shape[0] + 1, multiple):
        out = linear(x[:rows])
        if not all(torch.equal(out[i], lone[i]) for i in range(rows)):
            return False
    return True


@torch.inference_mode()
def decode_batch(
    stack: DecoderStack,
    caches: Sequence[KVCache],
    tokens: Sequence[int],
    invariant: bool = False,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> torch.Tensor:
    """One token for each request, at position caches[i].length; returns logits [n, vocab].

    The rows share every linear layer (q/k/v/o, MLP, lm_head): each weight is read once for
    all of them; each row attends to its own request's cache only. Appends each token's K/V to
    its cache; every cache must have room for one more row. A request's logits never depend on
    its companions. Where the stack's native step runs (engine/model/native_step.py), the whole
    step is one call and every row is bitwise its lone step by construction (`invariant` and
    `max_rows` change nothing). Elsewhere the twin (`twin_batch`) runs the model's modules.
    A cache with a reading (APE's, `KVCache.reading`) always decodes on the twin, whose
    attention can read as it says; the native step keeps the other rows of the batch.
    """
    native = native_step(stack)
    reads = [cache.reading is not None for cache in caches]
    if native is not None and not any(reads):
        return native(caches, tokens)
    if native is None or all(reads):
        return twin_batch(stack, caches, tokens, invariant, max_rows)
    plain = [i for i, read in enumerate(reads) if not read]
    reading = [i for i, read in enumerate(reads) if read]
    plain_logits = native([caches[i] for i in plain], [tokens[i] for i in plain])
    read_logits = twin_batch(
        stack, [caches[i] for i in reading], [tokens[i] for i in reading], invariant, max_rows
    )
    logits = plain_logits.new_empty(len(caches), plain_logits.shape[1])
    logits[plain], logits[reading] = plain_logits, read_logits
    return logits


_build_lock = threading.Lock()


def native_step(stack: DecoderStack) -> NativeDecodeStep | None:
    """The stack's native decode step (`stack.native`), built on the first call: on the thread
    that decodes, since building it computes (a probe against the twin, a quantized copy of
    the weights for `decode_weights` other than `model`). None where it cannot run."""
    if stack.native is not None or stack.native_unfit is not None:
        return stack.native
    with _build_lock:
        if stack.native is None and stack.native_unfit is None:
            built = build_native_step(stack, stack.decode_weights, partial(twin_batch, stack))
            if built is None:
                stack.native_unfit = "it disagreed with the twin on a probe"
                if needs_native_step(stack.decode_weights):
                    raise CpuKernelError(
                        f"decode weights {stack.decode_weights!r} need the native decode step, "
                        "which disagreed with the twin on a probe"
                    )
            stack.native = built
    return stack.native


@torch.inference_mode()
def twin_batch(
    stack: DecoderStack,
    caches: Sequence[KVCache],
    tokens: Sequence[int],
    invariant: bool = False,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> torch.Tensor:
    """`decode_batch` on the model's own modules, one operation at a time (the native step's
    twin). Rows are padded to a multiple of `row_multiple(stack, max_rows)` (`max_rows`: the
    largest batch the caller forms), so a request's logits do not depend on its companions; a
    lone request runs unpadded (cheaper) unless `invariant`, which pads it too and makes its
    logits independent of the batch in every case. Attention runs on the stack's
    `decode_attention` (engine/model/decode_attention.py), a request whose cache has a reading
    by that reading (`ReadingStepAttention`).
    """
    n = len(caches)
    multiple = row_multiple(stack, max(max_rows, n))
    rows = n if n == 1 and not invariant else -(-n // multiple) * multiple
    device = caches[0].data.device
    positions = [cache.length for cache in caches]
    pos = torch.tensor(positions + [0] * (rows - n), device=device)
    # [rows, hidden]
    hidden = stack.embed(torch.tensor(list(tokens) + [0] * (rows - n), device=device))
    attention = step_attention(stack.decode_attention, caches, positions, stack.scale)
    if any(cache.reading is not None for cache in caches):
        attention = ReadingStepAttention(attention, caches, positions, stack.scale)
    # the same rows at every layer (it reads hidden's dtype only)
    cos, sin = stack.rope_tables(pos, hidden)
    for layer in range(stack.spec.num_layers):
        x = stack.input_norm(layer, hidden)
        kv = torch.stack(
            stack.project_kv(layer, x, cos, sin, decode=True)
        )  # [2, kv_heads, rows, head_dim]
        for i, (cache, position) in enumerate(zip(caches, positions)):
            cache.data[layer, :, :, position] = kv[:, :, i]
        q = stack.project_q(layer, x, cos, sin, decode=True)  # [heads, rows, head_dim]
        hidden = stack.finish_layer(layer, hidden, attention(layer, q), decode=True)
    for cache, position in zip(caches, positions):
        cache.length = position + 1
    return stack.logits(hidden)[:n]


def pick_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    # float64 and the maximum taken out first: a temperature as small as 5e-324 is still a
    # number there (in float32 it is 0, and the division gives NaN probabilities)
    scaled = (logits.double() - logits.max().double()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches top_p (always keeps the top
    one)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    outside = mass_before >= top_p
    outside[0] = False  # a top_p that rounds to 0 in the probabilities' dtype would drop them all
    sorted_probs[outside] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def new_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The request's own random generator (None: torch's global one, for unseeded requests)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TokenIds(Protocol):
    """A stream of token ids that its consumer may close early: `generate_ids`'s generator, or
    the scheduler's `TokenStream` (closing it cancels the request's decoding). Its end carries
    the check's verdict: the `StopIteration` that ends it holds a `Fired` or None (`ended_by`),
    the one hand-off of a check's result from the thread that decodes to the stream's reader."""

    def __iter__(self) -> Iterator[int]: ...

    def __next__(self) -> int: ...

    def close(self) -> None: ...


def ended_by(end: StopIteration) -> Fired | None:
    """The check's verdict that the end of a `TokenIds` stream carries (None: no check fired)."""
    return end.value if isinstance(end.value, Fired) else None


class TextStream:
    """Text pieces of a stream of token ids (see `stream_text`); `close` also closes the ids'
    source, which for a batched request cancels its decoding."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, ids: TokenIds, collected: list[int] | None = None
    ):
        self._ids = ids
        self._pieces = stream_text(tokenizer, ids, collected)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()
        self._ids.close()


def stream_text(
    tokenizer: PreTrainedTokenizerBase, ids: Iterator[int], collected: list[int] | None = None
) -> Generator[str, None, None]:
    """Turn a stream of ids into text pieces; pieces concatenate to decode(all ids).

    Holds a piece back while it ends in an incomplete UTF-8 sequence. Every id is appended
    to `collected` when given, so the caller can count tokens.
    """
    tokens = collected if collected is not None else []
    emitted = ""
    for token in ids:
        tokens.append(token)
        text = _decode(tokenizer, tokens)
        if text.endswith("\ufffd"):
            continue
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted) :]
            emitted = text
    text = _decode(tokenizer, tokens)
    if len(text) > len(emitted) and text.startswith(emitted):
        yield text[len(emitted) :]


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of a list of ids (`decode` is typed for batches too; one list gives one str)."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=True))
