"""Load the model and tokenizer, and fingerprint them.

Which checkpoint, never from the network (engine/model/known.py `checkpoint_of`): a known model
by name (the embedded SmolLM2-135M-Instruct by default, converted once from its GGUF; a pulled
one), or a local checkpoint of a supported family (Llama, Mistral, Qwen2, Qwen3;
engine/model/families.py refuses the others at load) by path: a Hugging Face folder, or a
`.gguf` file converted once (engine/model/gguf.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import KvMosaicError
from engine.model import prefill_attention
from engine.model.attention import prepare_device
from engine.model.cpu import (
    CPUINFO,
    arithmetic_of,
    cpu_has_amx_bf16,
    cpu_has_avx512_bf16,
    native_bfloat16,
)
from engine.model.families import check_architecture, check_model_type
from engine.model.known import KnownModel, checkpoint_of, configured_known_model
from engine.model.known import embedded_checkpoint as embedded_checkpoint
from engine.model.linear import linear_kernel_of, use_linear_kernel
from engine.model.row_tiles import row_tile_for

if TYPE_CHECKING:  # transformers is imported only when a model is loaded
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts the runner needs, read once from the model config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int
    vocab_size: int


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, its spec and a fingerprint that goes into every cache key."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    # the known model (engine/model/known.py) this was loaded as; None: a checkpoint by path or
    # a model built in memory
    known_name: str | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_dtype(
    name: str,
    device: str,
    amx: bool | None = None,
    known: KnownModel | None = None,
    avx512_bf16: bool | None = None,
) -> torch.dtype:
    """ "auto" is float16 on CUDA; bfloat16 on a CPU with AMX-BF16, and on one with AVX512-BF16
    for a known model whose rule passed there (`KnownModel.bfloat16_on_avx512_bf16`); float32
    on other CPUs. `amx` and `avx512_bf16` override the CPU's flags (tests).

    bfloat16 where AMX makes its products native: it kept task accuracy and stayed inside full
    prefill's own reorder floor on the answerable report cases, and serves more requests per
    second (docs/benchmarks/bfloat16.md, "auto"). AVX512-BF16 without AMX has native bfloat16
    dot products too; there the rule is run per model (docs/benchmarks/bfloat16.md, "auto on
    AVX512-BF16, run"), and a model it has not passed for stays float32. Elsewhere bfloat16 is
    emulated.
    """
    if name == "auto":
        if device.startswith("cuda"):
            return torch.float16
        amx = cpu_has_amx_bf16() if amx is None else amx
        avx512_bf16 = cpu_has_avx512_bf16() if avx512_bf16 is None else avx512_bf16
        passed = known is not None and known.bfloat16_on_avx512_bf16
        return torch.bfloat16 if amx or (avx512_bf16 and passed) else torch.float32
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(table)}")
    return table[name]


def auto_dtype_reason(device: str, cpuinfo: Path = CPUINFO, known: KnownModel | None = None) -> str:
    """Why `auto` picks its dtype on `device` for the `known` model (None: a checkpoint by
    path), in words for a log line (the CPU's flags read from `cpuinfo`)."""
    if device.startswith("cuda"):
        return "float16 on CUDA"
    native = native_bfloat16(cpuinfo)
    if native == "AMX-BF16":
        return "bfloat16: this CPU has AMX-BF16 (docs/benchmarks/bfloat16.md, auto)"
    if native == "AVX512-BF16" and known is not None and known.bfloat16_on_avx512_bf16:
        return (
            f"bfloat16: this CPU has native bfloat16 dot products (AVX512-BF16) and "
            f"{known.name} passed auto's rule there (docs/benchmarks/bfloat16.md, auto on "
            "AVX512-BF16, run); KVMOSAIC_DTYPE=float32 keeps float32"
        )
    if native == "AVX512-BF16":
        model = known.name if known is not None else "a checkpoint by path"
        return (
            "float32: this CPU has native bfloat16 dot products (AVX512-BF16) but no AMX, and "
            f"auto's rule for it has not passed for {model} (docs/benchmarks/bfloat16.md, auto "
            "on AVX512-BF16, run); KVMOSAIC_DTYPE=bfloat16 takes it (faster, other roundings)"
        )
    return "float32: this CPU emulates bfloat16 products (no AVX512-BF16, no AMX)"


def load_model(
    data_dir: Path,
    model_path: str | None,
    device: str,
    dtype: str,
    linear_kernel: str = "auto",
    model_name: str | None = None,
) -> LoadedModel:
    """Load a known model by name, a local checkpoint by path (at most one of the two) or the
    embedded default, its linear layers on `linear_kernel` (engine/model/linear.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = checkpoint_of(Path(data_dir), model_name, model_path)
    if not source.is_dir():
        raise KvMosaicError(
            f"model path {source} is not a directory with a Hugging Face checkpoint"
        )
    _check_checkpoint_config(source)
    known = configured_known_model(model_name, model_path)
    torch_dtype = resolve_dtype(dtype, device, known=known)
    if dtype == "auto":
        log.info("dtype auto: %s", auto_dtype_reason(device, known=known))
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=True)
    # PreTrainedModel.to is wrapped with functools.wraps, which typeshed types as unbound
    # (self first)
    model = model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]
    prepare_device(torch.device(device))
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    log.info("loaded model from %s in %.2fs", source, time.perf_counter() - started)
    return dataclasses.replace(
        wrap_model(model, tokenizer, linear_kernel), known_name=known.name if known else None
    )


def _check_checkpoint_config(source: Path) -> None:
    """Refuse an unsupported architecture from its config.json alone, before any weight is read
    (engine/model/families.py; UnsupportedModel says why and what to do). The model type is read
    raw first, so a type that transformers itself does not know is refused the same way."""
    from transformers import AutoConfig

    config_file = source / "config.json"
    if not config_file.is_file():
        raise KvMosaicError(
            f"model path {source} has no config.json: not a Hugging Face checkpoint"
        )
    check_model_type(str(json.loads(config_file.read_text()).get("model_type")))
    check_architecture(AutoConfig.from_pretrained(source, local_files_only=True))


def wrap_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, linear_kernel: str = "auto"
) -> LoadedModel:
    """Check that `model` is a supported decoder (engine/model/families.py; UnsupportedModel if
    not),
    put its linear layers on `linear_kernel` (engine/model/linear.py; in place) and build its spec,
    EOS ids and fingerprint."""
    config = model.config
    log.info("model: %s", check_architecture(config))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    spec = ModelSpec(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        max_positions=config.max_position_embeddings,
        vocab_size=config.vocab_size,
    )
    dtype = next(model.parameters()).dtype
    use_linear_kernel(model, linear_kernel, row_tile_for(next(model.parameters()).device))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        fingerprint=model_fingerprint(model, tokenizer, dtype),
        eos_token_ids=_eos_token_ids(model, tokenizer),
    )


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise KvMosaicError("the model defines no EOS token")
    return tuple(sorted(ids))


# ---------------------------------------------------------------------------------------------
# fingerprint


def model_fingerprint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype
) -> str:
    """sha256 over config, tokenizer, dtype, a weights digest, the linear kernel, the machine's
    arithmetic (`arithmetic_of`) and the row tiles of a prefill's products and attention; 16
    hex digits.

    The weights digest hashes every parameter's name and shape and an evenly strided sample
    of up to 4096 of its values: any real change of checkpoint changes it, and it takes
    milliseconds instead of hashing half a gigabyte at every start.
    """
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "quantization_config",
        "dtype",
        "torch_dtype",
    ):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(tokenizer_digest(tokenizer).encode())
    h.update(str(dtype).encode())
    h.update(weights_digest(model).encode())
    # another kernel's KV differs in the last bits (torch's keeps its old fingerprint)
    if linear_kernel_of(model) != "torch":
        h.update(linear_kernel_of(model).encode())
    # so do products computed in other row tiles (engine/model/row_tiles.py) and attention
    # tiles of fewer query rows than a whole tile (before `_tiled_tail` padded them)
    device = next(model.parameters()).device
    # and so do other kernels: another torch, CPU vendor or instruction set (engine/model/cpu.py)
    h.update(arithmetic_of(str(device)).encode())
    tile = row_tile_for(device)
    if tile is not None:
        h.update(f"row tiles {tile}, whole attention tiles".encode())
    # and a bfloat16 tail's attention on AVX512-BF16's kernel (engine/model/prefill_attention.py)
    attention = prefill_attention.kernel_for(dtype, device)
    if attention == "avx512-bf16":
        h.update(f"prefill attention {attention}".encode())
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """Digest of the vocabulary, merges and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()


def weights_digest(model: torch.nn.Module, sample: int = 4096) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        picked = flat[::step][:sample].to(device="cpu", dtype=torch.float32)
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()
