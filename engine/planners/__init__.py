"""Recompute planners, one per mode, created by name.

Adding a mode is one new module with a `@register`-ed `BasePlanner` subclass
(`engine/planners/registry.py`) plus one import line below.
"""

from __future__ import annotations

from engine.planners.registry import (
    PLANNERS,
    Mode,
    base_reader_names,
    create_planner,
    exact_reuse_mode,
    exact_reuse_planner,
    planner_class,
    planner_names,
    reference_mode,
    reference_planner,
    register,
)

__all__ = [
    "PLANNERS",
    "Mode",
    "base_reader_names",
    "create_planner",
    "exact_reuse_mode",
    "exact_reuse_planner",
    "planner_class",
    "planner_names",
    "reference_mode",
    "reference_planner",
    "register",
]

# one line per mode, in the order `planner_names()` lists them
# isort: off
from engine.planners import full  # noqa: F401
from engine.planners import prefix  # noqa: F401
from engine.planners import naive  # noqa: F401
from engine.planners import epic  # noqa: F401
from engine.planners import cacheblend  # noqa: F401
from engine.planners import cachecraft  # noqa: F401
# isort: on
