"""Which dtype computes base KV (`EngineConfig.encode_dtype`), and the model copy that does it.

Ingest is almost all matrix products (SmolLM2, 3 MuSiQue records: 83% of ingest time in
`encode_chunks`, 77% of it in linear layers, which run near the rate a lone float32 product
of these shapes reaches on the 2-core machine: packing cannot buy much more).
On CPUs with AMX-BF16 a bfloat16 product of ingest's shapes runs 5.7-6.3x faster than
float32 (576x1536 weights, 64-2048 rows), and encoding a record's 6 chunks 2.5x faster
(3.69 s -> 1.47 s). Blended first-token KL does not notice: served by the float32 engine
after float16 storage, first-token KL against full prefill changed by -0.0019 +/- 0.0015
(`cacheblend`, MuSiQue 0-11) and +0.0058 +/- 0.0034 (`naive`, no recompute at all); on
records 100-119 by +0.0018 +/- 0.0015 (`cacheblend`) and +0.0017 +/- 0.0011 (`cachecraft`),
without the guard. Ingest of the workload corpus (MuSiQue 100-111, 67,274 tokens; `kvmosaic
bench ingest`): 1,684 tokens/s against 906 packed in float32 and 806 one chunk per pass.

But a bfloat16 base variant is not exact: the first chunk's base variant, which `prefix`
reuses as is and the guard's repairs keep as exact leading rows, differs from what full
prefill computes by bfloat16's rounding, so greedy answers split at near-ties. Through the
server on the workload's default trace (c=1) 3 of 32 `cachecraft` answers differed from
full's (EM 0.91, ROUGE-L 0.96) where float32 base KV gave 32 of 32. So the default is
"engine"; "auto" (bfloat16 on such CPUs, the engine's dtype elsewhere, where bfloat16
products are emulated and slower) and "bfloat16" are opt-in. The copy's KV carries the
engine's fingerprint: it is the same weights, rounded, and the store serves it like its own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import torch

from engine.model import LoadedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_has_amx_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """True when the CPU flags list `amx_bf16` (Linux; False where /proc/cpuinfo is absent)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in text.splitlines())


def resolve_encode_dtype(name: str, loaded: LoadedModel, amx: bool | None = None) -> torch.dtype:
    """The dtype base KV is computed in; `amx` overrides the CPU check (tests)."""
    if name == "engine":
        return loaded.dtype
    if name == "auto":
        amx = cpu_has_amx_bf16() if amx is None else amx
        on_cpu_float32 = loaded.device.type == "cpu" and loaded.dtype == torch.float32
        return torch.bfloat16 if on_cpu_float32 and amx else loaded.dtype
    if name not in DTYPES:
        raise ValueError(f"unknown encode dtype {name!r}; use auto, engine or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def model_in(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """`loaded` itself when it already runs in `dtype`, else a copy of its model cast to it
    (same tokenizer, spec and fingerprint)."""
    if loaded.dtype == dtype:
        return loaded
    model = copy.deepcopy(loaded.model)
    torch.nn.Module.to(model, dtype)  # in place; PreTrainedModel.to's typing does not take a dtype
    return dataclasses.replace(loaded, model=model)
