"""Which Hugging Face decoders the engine serves, and why any other is refused at load.

The engine drives a model's own modules layer by layer (engine/model/layers.py) and moves cached K
to a new position by re-rotating it (`ops.rope_shift_`). Both are exact only for a
Llama-layout decoder whose every layer attends over every earlier key and whose RoPE
frequencies are fixed, so that RoPE(p + d) = R(d) RoPE(p). `check_architecture` reads a
config against those conditions before a request runs: a model the engine cannot serve
exactly is refused with the reason and what to do, never answered wrongly later. This
module reads configs only; the start-up self-check (engine/model/selfcheck.py) then proves the
rotation on the loaded weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.errors import UnsupportedModel

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# Llama-layout decoders: embed -> (RMSNorm, q/k/v/o, RoPE, SwiGLU MLP) x layers -> norm -> lm_head.
# Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm of q and k before RoPE (engine/model/layers.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# RoPE types whose frequencies are fixed for the model, so cached K moves by a pure rotation.
# YaRN's attention factor scales cos and sin of fresh rows only; the shift rotates and keeps it.
FIXED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Dynamic NTK keeps the base frequencies up to max_position_embeddings (which is then the
# engine's context) and recomputes them from the sequence length past it.
BOUNDED_ROPE_TYPES = ("dynamic",)

_SUPPORTED = ", ".join(SUPPORTED_MODEL_TYPES)
_ROPES = ", ".join(FIXED_ROPE_TYPES + BOUNDED_ROPE_TYPES)

# Why some well-known types are refused (any other unknown type gets the generic reason).
REFUSED_MODEL_TYPES: Mapping[str, str] = {
    "gemma": "Gemma scales embeddings and offsets its norms outside the modules the engine runs",
    "gemma2": "Gemma 2 alternates sliding-window and global layers and soft-caps attention logits",
    "gemma3": "Gemma 3 alternates sliding-window and global layers with two RoPE bases",
    "gemma3_text": "Gemma 3 alternates sliding-window and global layers with two RoPE bases",
    "mixtral": "its MLP is a mixture of experts, which the engine's row-wise steps do not run",
    "qwen2_moe": "its MLP is a mixture of experts, which the engine's row-wise steps do not run",
    "qwen3_moe": "its MLP is a mixture of experts, which the engine's row-wise steps do not run",
    "phi3": "it fuses q/k/v into one projection and uses longrope, whose frequencies switch "
    "with the length",
}


def check_architecture(config: PreTrainedConfig) -> str:
    """Refuse (UnsupportedModel) a config the engine cannot serve exactly; else describe it.

    Checks, in order: the model type, sliding-window layers, the RoPE type and rotary share.
    Returns a one-line description for the load log, e.g. "qwen3, rope yarn".
    """
    model_type = str(config.model_type)
    check_model_type(model_type)
    _check_sliding_window(config)
    rope = rope_parameters(config)
    _check_rope(config, rope)
    if rope["rope_type"] in BOUNDED_ROPE_TYPES:
        return (
            f"{model_type}, rope {rope['rope_type']} (context kept to max_position_embeddings, "
            f"{config.max_position_embeddings}, where its frequencies are fixed)"
        )
    return f"{model_type}, rope {rope['rope_type']}"


def check_model_type(model_type: str) -> None:
    """Refuse (UnsupportedModel) a model type outside SUPPORTED_MODEL_TYPES, saying why."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        reason = REFUSED_MODEL_TYPES.get(model_type, "the engine runs Llama-layout decoders only")
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: {reason}. Use a checkpoint of a "
            f"supported family ({_SUPPORTED}; docs/models.md), or serve this model without "
            f"kvmosaic"
        )


def rope_parameters(config: PreTrainedConfig) -> dict[str, Any]:
    """The config's RoPE parameters as one dict with "rope_type" (transformers 5 `rope_parameters`,
    or the older `rope_scaling`); {"rope_type": "default"} when it names none."""
    found = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(found)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def sliding_window_layers(config: PreTrainedConfig) -> tuple[int, ...]:
    """Indices of the layers that attend over a window shorter than the context.

    A window at least max_position_embeddings long never drops a key, so it is no window.
    Qwen2/3 slide only in the layers `layer_types` names "sliding_attention" (from
    use_sliding_window and max_window_layers); Mistral in every layer when sliding_window is set.
    """
    window = getattr(config, "sliding_window", None)
    if not window or window >= config.max_position_embeddings:
        return ()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return ()
    return tuple(range(config.num_hidden_layers))


def _check_sliding_window(config: PreTrainedConfig) -> None:
    layers = sliding_window_layers(config)
    if not layers:
        return
    window, context = config.sliding_window, config.max_position_embeddings
    raise UnsupportedModel(
        f"model type {config.model_type!r} uses sliding-window attention in {len(layers)} of "
        f"{config.num_hidden_layers} layers (window {window} < context {context}): those layers "
        f"see only the last {window} keys, while the engine attends over every earlier key, so "
        f"prompts past the window would get answers the model never gives. Use a checkpoint "
        f"without a sliding window (e.g. Mistral-7B v0.2 or later: sliding_window null; Qwen: "
        f"use_sliding_window false), or set max_position_embeddings to at most {window} in its "
        f"config.json, so that every prompt fits inside the window, where both agree"
    )


def _check_rope(config: PreTrainedConfig, rope: Mapping[str, Any]) -> None:
    rope_type = rope["rope_type"]
    if rope_type not in FIXED_ROPE_TYPES + BOUNDED_ROPE_TYPES:
        raise UnsupportedModel(
            f"RoPE type {rope_type!r} is not supported: cached chunk KV moves to a new position "
            f"by re-rotating K, which equals a fresh RoPE only while the frequencies do not "
            f"depend on the sequence length or layer. Supported RoPE types: {_ROPES}; use a "
            f"checkpoint with one of them"
        )
    default_share = getattr(config, "partial_rotary_factor", None) or 1.0
    share = float(rope.get("partial_rotary_factor", default_share))
    if share != 1.0:
        raise UnsupportedModel(
            f"partial_rotary_factor {share} is not supported: the engine rotates every "
            f"dimension of a head; use a checkpoint whose RoPE covers the whole head"
        )
