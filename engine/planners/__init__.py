"""Recompute planners, one per mode, created by name.

Adding a mode is one new module with a `@register`-ed `BasePlanner` subclass plus one import
line below.
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


def create_planner(name: str, config: EngineConfig) -> BasePlanner:
    if name not in PLANNERS:
        raise UnknownMode(f"unknown mode {name!r}; known modes: {', '.join(PLANNERS)}")
    return PLANNERS[name](config)


# one line per mode
from engine.planners import full  # noqa: E402,F401
from engine.planners import prefix  # noqa: E402,F401
from engine.planners import naive  # noqa: E402,F401
from engine.planners import epic  # noqa: E402,F401
from engine.planners import cacheblend  # noqa: E402,F401
from engine.planners import cachecraft  # noqa: E402,F401
