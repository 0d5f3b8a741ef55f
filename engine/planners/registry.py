"""The planner registry: mode name -> `BasePlanner` subclass, and the lookups over it.

A planner module registers itself with `@register`; `engine/planners/__init__.py` imports every
planner module once, so the registry is full whenever `engine.planners` is imported. Kept apart
from the package's `__init__` so that no planner module imports the package that imports it.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import UnknownMode
from engine.planners.base import BasePlanner

PLANNERS: dict[str, type[BasePlanner]] = {}


def register(cls: type[BasePlanner]) -> type[BasePlanner]:
    PLANNERS[cls.name] = cls
    return cls


def planner_names() -> list[str]:
    return list(PLANNERS)


def planner_class(name: str) -> type[BasePlanner]:
    """The registered planner of mode `name` (its class attributes are the mode's policy)."""
    if name not in PLANNERS:
        raise UnknownMode(f"unknown mode {name!r}; known modes: {', '.join(PLANNERS)}")
    return PLANNERS[name]


def create_planner(name: str, config: EngineConfig) -> BasePlanner:
    return planner_class(name)(config)


def reference_mode() -> str:
    """The mode of the plain prefill every reuse mode stands in for (the one reusing no cache)."""
    return next(name for name, cls in PLANNERS.items() if not cls.reuses_cache)


def reference_planner(config: EngineConfig) -> BasePlanner:
    """The reference prefill's planner (the fallback when reuse is off)."""
    return PLANNERS[reference_mode()](config)


def exact_reuse_planner(config: EngineConfig) -> BasePlanner:
    """The planner that reuses only an exact prefix and computes the rest (`exact_reuse`)."""
    return next(cls for cls in PLANNERS.values() if cls.exact_reuse)(config)
