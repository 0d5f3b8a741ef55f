"""The decode step in C: every layer, the attention and lm_head of a step in one call.

`engine/cpu/decode_step.c` runs a whole step of a Llama-family decoder for every row of a batch
(one per request): per layer the RMSNorm, q/k/v in one pass over their weights, Qwen3's per-head
norms, RoPE, the new K and V into each request's cache, the attention of each row over its own
cache, o_proj and the residual, the MLP (gate and up in one pass, SiLU(gate) * up, down) and the
residual; then the final norm and lm_head. The weights are read in the format `decode_weights`
names (engine/model/decode_weights.py). The twin is the stack's per-row steps with the model's
own modules (`decode.decode_batch` without a native step).

Why: a decode step reads every weight once and does little else, yet through PyTorch most of
its time went to the ~30 small operations per layer and their Python between the products, and
to one-row products that read the weights slower than the memory allows
(docs/benchmarks/decode.md). Here a step is one call and one OpenMP team.

`native_step_unfit` says, cheaply, whether a model can run here (nothing computed);
`NativeDecodeStep` is built on the first step (on the thread that decodes), which quantizes the
weights if asked and first checks the kernel against the twin on the model's own weights. A
row's result never depends on its companions or on the thread count (the kernel's docstring),
so a batched row is bitwise the row decoded alone and no padding is needed.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from engine.cpu import library
from engine.kv import KVCache
from engine.model.decode_weights import AUTO_CANDIDATES, FORMATS, PackedMatrix, formats_for, pack
from engine.model.loader import ModelSpec

log = logging.getLogger(__name__)

# the kernel's phases (decode_step.c PHASE_*), in its order
PHASES = ("norms", "qkv", "rope", "attention", "o", "gate_up", "down", "lm_head")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


class DecoderStack(Protocol):
    """What the native step reads of `engine.model.layers.DecoderStack` (which builds one, so
    it cannot be imported here without a cycle)."""

    model: Any
    model_dtype: torch.dtype
    spec: ModelSpec
    layers: Any
    final_norm: Any
    lm_head: Any
    scale: float
    decode_attention: str
    rounded_decode_weights: str | None

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def rope_tables(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Matrix(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        *[(name, Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")],
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int32)
            for name in (
                "num_layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "vocab",
                "cache_dtype",
            )
        ],
        ("norm_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", Matrix),
    ]


def native_step_unfit(stack: DecoderStack) -> str | None:
    """Why the native step cannot run this stack's model here, or None if it can (reads the
    modules and the library; computes nothing)."""
    if stack.decode_attention != "native":
        return "the decode attention is torch's"
    lib = library.get()
    if lib is None or not lib.decode_step_supported:
        return "the kernel library was built without AVX-512F or AVX2 (with FMA and F16C)"
    spec = stack.spec
    config = getattr(stack.model, "config", None)
    activation = str(getattr(config, "hidden_act", "silu"))
    if activation not in SUPPORTED_ACTIVATIONS:
        return f"its MLP activation is {activation}, not SiLU"
    sizes = (spec.hidden_size, spec.num_heads * spec.head_dim, _intermediate(stack))
    if any(size % 32 for size in sizes):
        return f"its hidden, attention and MLP sizes {sizes} are not all multiples of 32"
    for layer in stack.layers:
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [
            getattr(layer.self_attn, name)
            for name in ("q_norm", "k_norm")
            if hasattr(layer.self_attn, name)
        ]
        if not all(_is_rms_norm(norm) for norm in norms):
            return "its norms are not RMSNorm"
        if not all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP is not gate / up / down"
    if (
        len(
            {_eps(norm) for layer in stack.layers for norm in _norms(layer)}
            | {_eps(stack.final_norm)}
        )
        != 1
    ):
        return "its norms do not share one epsilon"
    return None


class NativeDecodeStep:
    """A model's decode step on the kernel, its weights in `weights` format (decode_weights.py).

    Thread-safe once built: the structures it hands the kernel are read-only."""

    def __init__(self, stack: DecoderStack, weights: str):
        lib = library.get()
        if lib is None:
            raise library.CpuKernelError("the CPU kernel library is unavailable")
        self.lib, self.stack, self.weights = lib, stack, weights
        self._keep: list[torch.Tensor] = []  # every tensor the structures point into
        spec = stack.spec
        layer_format, head_format = formats_for(weights, stack.model_dtype)
        self.packed: list[PackedMatrix] = []
        layers = (Layer * spec.num_layers)()
        modules: Sequence[Any] = stack.layers  # the Llama layout, checked by native_step_unfit
        final_norm, lm_head = cast(Any, stack.final_norm), cast(Any, stack.lm_head)
        for i, layer in enumerate(modules):
            attn, mlp = layer.self_attn, layer.mlp
            layers[i] = Layer(
                self._vector(layer.input_layernorm.weight),
                self._vector(layer.post_attention_layernorm.weight),
                self._vector(attn.q_norm.weight) if hasattr(attn, "q_norm") else None,
                self._vector(attn.k_norm.weight) if hasattr(attn, "k_norm") else None,
                *[
                    self._matrix(module, layer_format)
                    for module in (
                        attn.q_proj,
                        attn.k_proj,
                        attn.v_proj,
                        attn.o_proj,
                        mlp.gate_proj,
                        mlp.up_proj,
                        mlp.down_proj,
                    )
                ],
            )
        self._layers = layers
        self.model = Model(
            spec.num_layers,
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            _intermediate(stack),
            int(lm_head.weight.shape[0]),
            library.CACHE_DTYPES[str(stack.model_dtype).removeprefix("torch.")],
            _eps(final_norm),
            stack.scale,
            ctypes.addressof(layers),
            self._vector(final_norm.weight),
            self._matrix(lm_head, head_format),
        )
        # bytes a step reads: every matrix once (a tied lm_head too), and the norms
        self.weight_bytes = sum(p.nbytes for p in self.packed) + sum(
            t.numel() * t.element_size() for t in self._keep if t.dim() == 1
        )
        self.exact = min((p.exact for p in self.packed), default=1.0)
        # seconds per kernel phase, added up while not None (bench/compute/decode.py reads it)
        self.profile: dict[str, float] | None = None

    def __call__(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Logits [n, vocab] (float32) of one token per request at position caches[i].length;
        appends each token's K/V to its cache (every cache must have room for one more row)."""
        n, stack = len(caches), self.stack
        dtype = stack.model_dtype
        for cache in caches:
            if (
                cache.data.dtype != dtype
                or not cache.data.is_contiguous()
                or cache.data.device.type != "cpu"
            ):
                raise ValueError(
                    f"the native decode step needs contiguous {dtype} caches on the CPU"
                )
            if cache.length >= cache.capacity:
                raise ValueError("a cache has no room for the step's row")
        positions = [cache.length for cache in caches]
        hidden = stack.embed(torch.tensor(list(tokens))).float().contiguous()  # [n, hidden]
        cos, sin = (
            t.float().contiguous() for t in stack.rope_tables(torch.tensor(positions), hidden)
        )
        meta = torch.tensor(
            [[c.data.data_ptr() for c in caches], [c.capacity for c in caches], positions],
            dtype=torch.int64,
        )
        logits = torch.empty(n, self.model.vocab)
        phases = (ctypes.c_double * len(PHASES))() if self.profile is not None else None
        status = self.lib.decode_step(
            ctypes.byref(self.model),
            n,
            _ptr(hidden),
            _ptr(cos),
            _ptr(sin),
            _ptr(meta[0]),
            _ptr(meta[1]),
            _ptr(meta[2]),
            _ptr(logits),
            torch.get_num_threads(),
            phases,
        )
        self.lib.check("kvm_cpu_decode_step", status)
        for cache in caches:
            cache.length += 1
        if self.profile is not None and phases is not None:
            for name, seconds in zip(PHASES, phases):
                self.profile[name] = self.profile.get(name, 0.0) + seconds
        return logits

    def _vector(self, tensor: torch.Tensor) -> int:
        kept = tensor.detach().float().contiguous()
        self._keep.append(kept)
        return kept.data_ptr()

    def _matrix(self, module: Any, format: str) -> Matrix:
        packed = pack(module.weight, format)
        self.packed.append(packed)
        parts = [packed.data, packed.scales, packed.mins]
        self._keep += [t for t in parts if t is not None]
        bias = getattr(module, "bias", None)
        return Matrix(
            FORMATS[packed.format],
            packed.rows,
            packed.cols,
            0,
            packed.data.data_ptr(),
            None if packed.scales is None else packed.scales.data_ptr(),
            None if packed.mins is None else packed.mins.data_ptr(),
            None if bias is None else self._vector(bias),
        )


def build_native_step(
    stack: DecoderStack,
    weights: str,
    twin: Callable[[Sequence[KVCache], Sequence[int]], torch.Tensor],
) -> NativeDecodeStep | None:
    """The stack's native step, after a probe: the kernel on the model's own weights against the
    twin (`twin(caches, tokens)`) on one batched step over random caches; None (logged) if they
    disagree beyond the dtype's rounding. `auto` takes the first of `AUTO_CANDIDATES` narrower
    than the rounded weights measured for the model in its dtype (`stack.rounded_decode_weights`)
    whose every block is exact (the decode is then `model`'s bit for bit), else those rounded
    weights, else `model`."""
    own = NativeDecodeStep(stack, "model")
    reason = _probe(stack, own, twin)
    if reason is not None:
        log.warning("native decode step disabled: %s", reason)
        return None
    if weights == "auto":
        rounded = stack.rounded_decode_weights
        exact = _exact_narrowest(stack, narrower_than=rounded)
        step = exact or (NativeDecodeStep(stack, rounded) if rounded else own)
    else:
        step = own if weights == "model" else NativeDecodeStep(stack, weights)
    log.info(
        "native decode step: %s weights (asked: %s), %.0f MB per step, %.1f%% of blocks exact",
        step.weights,
        weights,
        step.weight_bytes / 1e6,
        100 * step.exact,
    )
    return step


def _exact_narrowest(
    stack: DecoderStack, narrower_than: str | None = None
) -> NativeDecodeStep | None:
    """The first candidate format (before `narrower_than` among them, if given) that holds every
    weight exactly, or None. One matrix is tried first, so a model whose weights fit no block
    grid costs one matrix's quantization."""
    sample = cast(Any, stack.layers[0]).self_attn.q_proj.weight
    candidates: tuple[str, ...] = AUTO_CANDIDATES
    if narrower_than in candidates:
        candidates = candidates[: candidates.index(narrower_than)]
    for weights in candidates:
        layer_format, _ = formats_for(weights, stack.model_dtype)
        if pack(sample, layer_format).exact < 1.0:
            continue
        step = NativeDecodeStep(stack, weights)
        if step.exact == 1.0:
            return step
    return None


def _probe(
    stack: DecoderStack,
    step: NativeDecodeStep,
    twin: Callable[[Sequence[KVCache], Sequence[int]], torch.Tensor],
) -> str | None:
    spec, dtype = stack.spec, stack.model_dtype
    generator = torch.Generator().manual_seed(0)
    lengths, tokens = [7, 300], [1, 2]
    caches = []
    for length in lengths:
        cache = KVCache(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            length + 1,
            dtype,
            torch.device("cpu"),
        )
        cache.data.copy_(torch.randn(cache.data.shape, generator=generator) * 0.5)
        cache.length = length
        caches.append(cache)
    copies = [_copy(cache) for cache in caches]
    got, expected = step(caches, tokens), twin(copies, tokens)
    scale = float(expected.abs().max()) or 1.0
    tolerance = (1e-4 if dtype == torch.float32 else 5e-2) * scale
    error = float((got - expected).abs().max())
    if not error <= tolerance:
        return f"it disagreed with the twin by {error:.3g} (logits up to {scale:.3g})"
    return None


def _copy(cache: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.data, copy.length, copy.reading = cache.data.clone(), cache.length, cache.reading
    return copy


def _intermediate(stack: DecoderStack) -> int:
    return int(cast(Any, stack.layers[0]).mlp.gate_proj.weight.shape[0])


def _norms(layer: Any) -> list[Any]:
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    return norms + [
        getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n)
    ]


def _is_rms_norm(module: Any) -> bool:
    """The Llama-family RMSNorm (weight * x / rms(x), no offset), by its class name and fields."""
    return (
        type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight") and _eps(module) > 0
    )


def _eps(module: Any) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 0.0)))


def _ptr(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())
