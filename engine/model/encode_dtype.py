"""Which dtype computes base KV (`EngineConfig.encode_dtype`), and the model copy that does it.

`engine` (the default) computes base KV with the engine's own model. Any other dtype loads a
copy of the model in that dtype, once, on the first encoding; its KV is returned in the
engine's dtype and carries the engine's fingerprint (the same weights, rounded), so the store
serves it like the engine's own. `auto` picks `bfloat16` for a float32 engine on a CPU with
AMX-BF16 (where bfloat16 products are native and much faster) and the engine's dtype elsewhere
(where they are emulated and slower).

Why `engine` stays the default: ingest is almost all matrix products, so bfloat16 ingests much
faster and blended first-token KL does not notice, but a bfloat16 base variant is not exact:
the first chunk's base variant, which `prefix` reuses as is and the guard's repairs keep as
exact leading rows, differs from full prefill's by bfloat16's rounding, so greedy answers
split at near-ties (docs/benchmarks/bfloat16.md, "bfloat16 base KV"). Opt in where ingest
speed matters more.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from engine.model.cpu import cpu_has_amx_bf16
from engine.model.linear import fit_linear_kernel
from engine.model.loader import LoadedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_encode_dtype(name: str, loaded: LoadedModel, amx: bool | None = None) -> torch.dtype:
    """The dtype base KV is computed in; `amx` overrides the CPU check (tests)."""
    if name == "engine":
        return loaded.dtype
    if name == "auto":
        amx = cpu_has_amx_bf16() if amx is None else amx
        on_cpu_float32 = loaded.device.type == "cpu" and loaded.dtype == torch.float32
        return torch.bfloat16 if on_cpu_float32 and amx else loaded.dtype
    if name not in DTYPES:
        raise ValueError(
            f"unknown encode dtype {name!r}; use auto, engine or one of {', '.join(DTYPES)}"
        )
    return DTYPES[name]


def model_in(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """`loaded` itself when it already runs in `dtype`, else a copy of its model cast to it
    (same tokenizer, spec and fingerprint)."""
    if loaded.dtype == dtype:
        return loaded
    model = copy.deepcopy(loaded.model)
    torch.nn.Module.to(model, dtype)  # in place; PreTrainedModel.to's typing does not take a dtype
    # oneDNN may run the model's dtype and not this one (CPUs without bfloat16)
    fit_linear_kernel(model)
    return dataclasses.replace(loaded, model=model)
