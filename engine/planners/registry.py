"""The planner registry: mode name -> `BasePlanner` subclass, `Mode` (a mode resolved from its
name once, where a request enters) and the lookups over them.

A planner module registers itself with `@register`; `engine/planners/__init__.py` imports every
planner module once, so the registry is full whenever `engine.planners` is imported. Kept apart
from the package's `__init__` so that no planner module imports the package that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import UnknownMode
from engine.planners.base import BasePlanner, VariantUse, VariantYield

PLANNERS: dict[str, type[BasePlanner]] = {}


def register(cls: type[BasePlanner]) -> type[BasePlanner]:
    PLANNERS[cls.name] = cls
    return cls


def planner_names() -> list[str]:
    return list(PLANNERS)


def base_reader_names() -> list[str]:
    """The modes that read base variants only (`Mode.reads_bases_only`), in registry order."""
    return [name for name, cls in PLANNERS.items() if Mode(cls).reads_bases_only]


def planner_class(name: str) -> type[BasePlanner]:
    """The registered planner of mode `name` (its class attributes are the mode's policy)."""
    if name not in PLANNERS:
        raise UnknownMode(f"unknown mode {name!r}; known modes: {', '.join(PLANNERS)}")
    return PLANNERS[name]


@dataclass(frozen=True)
class Mode:
    """A request's mode, resolved from its name once where the request enters (`named`). Its
    planner class carries the mode's whole policy, read through the properties below: nothing
    below the edge compares a mode's name."""

    planner: type[BasePlanner]

    @classmethod
    def named(cls, name: str) -> Mode:
        """The mode called `name`; UnknownMode naming the known ones otherwise."""
        return cls(planner_class(name))

    @property
    def name(self) -> str:
        return self.planner.name

    @property
    def reuses_cache(self) -> bool:
        return self.planner.reuses_cache

    @property
    def exact(self) -> bool:
        return self.planner.exact

    @property
    def exact_reuse(self) -> bool:
        return self.planner.exact_reuse

    @property
    def variant_use(self) -> VariantUse:
        return self.planner.variant_use

    @property
    def leaves(self) -> VariantYield:
        return self.planner.leaves

    @property
    def blends(self) -> bool:
        return self.planner.blends()

    @property
    def reads_bases_only(self) -> bool:
        """It reuses the cache, plans with base variants only and leaves none behind: a
        request may read its chunks between learned packets (`Query.packets`)."""
        return (
            self.reuses_cache
            and self.variant_use is VariantUse.BASE
            and self.leaves is VariantYield.NONE
        )

    def create_planner(self, config: EngineConfig) -> BasePlanner:
        return self.planner(config)

    def __str__(self) -> str:
        return self.name


def create_planner(name: str, config: EngineConfig) -> BasePlanner:
    return planner_class(name)(config)


def reference_mode() -> Mode:
    """The plain prefill every reuse mode stands in for (the one reusing no cache)."""
    return Mode(next(cls for cls in PLANNERS.values() if not cls.reuses_cache))


def exact_reuse_mode() -> Mode:
    """The mode that reuses only an exact prefix and computes the rest (`exact_reuse`)."""
    return Mode(next(cls for cls in PLANNERS.values() if cls.exact_reuse))


def reference_planner(config: EngineConfig) -> BasePlanner:
    """The reference prefill's planner (the fallback when reuse is off)."""
    return reference_mode().create_planner(config)


def exact_reuse_planner(config: EngineConfig) -> BasePlanner:
    """The planner that reuses only an exact prefix and computes the rest (`exact_reuse`)."""
    return exact_reuse_mode().create_planner(config)
