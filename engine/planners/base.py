"""The planner contract: one `BasePlanner` subclass per mode turns a request into a `Plan`
(`engine/plan.py`), and its class attributes state the mode's variant policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar

from engine.config import EngineConfig
from engine.plan import Plan, PlanRequest


class VariantUse(str, Enum):  # noqa: UP042 (StrEnum would change str() of its members)
    """Which stored variants of a chunk a mode can plan with (`app.variants.policy`)."""

    BASE = "base"  # only the base variant, computed alone after the system prefix
    EXACT = "exact"  # the variant computed after exactly the chunks before it, else the base
    BEST = "best"  # the variant of lowest expected fix cost (Cache-Craft's CFO against blending)


class VariantYield(str, Enum):  # noqa: UP042 (StrEnum would change str() of its members)
    """What a mode's finished requests leave behind as new variants."""

    NONE = "none"  # nothing
    # the chunk rows its own prefill computed exactly in context (no extra work)
    HARVEST = "harvest"
    # the harvest, plus exact variants built in the background where reuse repays it
    BUILD = "build"


class BasePlanner(ABC):
    """Builds a Plan for a request. One subclass per mode, registered by `name`.

    The class attributes are the mode's whole variant policy: code outside the planner
    registry asks them, never the mode's name.
    """

    name: ClassVar[str]
    # False only for the reference `full`, which ignores every cache.
    reuses_cache: ClassVar[bool] = True
    # True when the plan's KV equals the reference prefill's whatever KV it is given (the
    # reference): the fidelity guard has nothing to check and never re-runs such a request.
    # A plan that is exact only over exact sources (`prefix`) leaves it False; the engine's
    # per-request `exact_state` (`PlanRequest.exact_chunks`) says when its state is exact.
    exact: ClassVar[bool] = False
    # True for the plan that reuses only an exact prefix and computes every later row (`prefix`):
    # the reference's result over exact sources, at the least work that guarantees it. The
    # fidelity guard runs it instead of a blend that would be repaired anyway
    # (engine/serving/busy.py).
    exact_reuse: ClassVar[bool] = False
    variant_use: ClassVar[VariantUse] = VariantUse.BASE
    leaves: ClassVar[VariantYield] = VariantYield.NONE

    def __init__(self, config: EngineConfig):
        self.config = config

    @classmethod
    def blends(cls) -> bool:
        """Its plan reuses cached chunks in contexts they were not computed in and fixes them
        inexactly: what the fidelity guard judges."""
        return cls.reuses_cache and not (cls.exact or cls.exact_reuse)

    @abstractmethod
    def plan(self, request: PlanRequest) -> Plan:
        """Return the plan; must not modify the request."""
