"""`KVMOSAIC_*` variables that nothing reads: a misspelt setting is named at start-up, with the
nearest known variable, instead of being ignored in silence.

Only warns: the environment may carry variables of another kvmosaic version or of the tests.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

PREFIX = "KVMOSAIC_"
# Read outside `Settings`: the engine's kernel build (engine/kernels/), the codec's former
# name (an alias of KVMOSAIC_STORE_CODEC), and the deployment files' own.
OTHER_VARIABLES = (
    "KVMOSAIC_KERNELS",
    "KVMOSAIC_KERNEL_LIBRARY",
    "KVMOSAIC_KERNEL_CACHE",
    "KVMOSAIC_NVCC",
    "KVMOSAIC_CUDA_ARCH",
    "KVMOSAIC_STORE_DTYPE",
    "KVMOSAIC_REPLICAS",
    "KVMOSAIC_PUBLIC_PORT",
)
# The test suite's and the benchmarks' own variables start with these.
OTHER_PREFIXES = ("KVMOSAIC_TEST_", "KVMOSAIC_SOAK_", "KVMOSAIC_SKIP_")


def known_variables() -> set[str]:
    """Every `KVMOSAIC_*` variable kvmosaic reads."""
    from app.settings import Settings

    return {PREFIX + name.upper() for name in Settings.model_fields} | set(OTHER_VARIABLES)


def unknown_variables(environ: Mapping[str, str], known: Iterable[str]) -> list[str]:
    """One line per `KVMOSAIC_*` name in `environ` that is not in `known`, naming the nearest
    known one when there is a close one."""
    known = sorted(known)
    lines = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in known or name.startswith(OTHER_PREFIXES):
            continue
        # compared without the prefix they all share, which would make any two look alike
        nearest = difflib.get_close_matches(
            name.removeprefix(PREFIX), [k.removeprefix(PREFIX) for k in known], n=1, cutoff=0.6
        )
        hint = (
            f" (did you mean {PREFIX}{nearest[0]}?)"
            if nearest
            else " (`kvmosaic settings` lists them)"
        )
        lines.append(f"{name} is not a kvmosaic setting and is ignored{hint}")
    return lines


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log a WARNING for each unknown `KVMOSAIC_*` variable (`os.environ` by default); returns
    the lines."""
    lines = unknown_variables(os.environ if environ is None else environ, known_variables())
    for line in lines:
        log.warning("%s", line)
    return lines
