"""What the benchmarks need beyond a server install: the `bench` extra of pyproject.toml.

A server install (`pip install kvmosaic`, the Docker image) carries only what serving needs;
`pip install 'kvmosaic[bench]'` (which scripts/setup.sh installs) adds these. A command that
needs one checks before it starts its run, so a missing package costs a message, not a run.
"""

from __future__ import annotations

from importlib.util import find_spec

from engine.errors import KvMosaicError

# import name -> what needs it
BENCH_EXTRAS = {"matplotlib": "the plots of `kvmosaic bench workload --report`"}


class MissingBenchExtra(KvMosaicError):
    """A benchmark needs a package of the `bench` extra that is not installed."""


def require(module: str) -> None:
    """Raise `MissingBenchExtra`, naming the install command, when `module` (a key of
    `BENCH_EXTRAS`) cannot be imported; return quietly when it can."""
    if find_spec(module) is None:
        raise MissingBenchExtra(
            f"{BENCH_EXTRAS[module]} need {module}, which is not installed: "
            "pip install 'kvmosaic[bench]'"
        )
