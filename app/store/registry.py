"""Tiers by name, and the tiered store built from a `StoreConfig`.

Adding a tier is one module plus one line in `TIERS`.
"""

from __future__ import annotations

import logging

from app.store.base import BaseTier, TierUnavailable
from app.store.config import StoreConfig
from app.store.disk import DiskTier
from app.store.memory import CpuTier, GpuTier
from app.store.policy import create_policy
from app.store.redis import RedisTier
from app.store.tiered import TieredStore

log = logging.getLogger(__name__)

TIERS: dict[str, type[BaseTier]] = {t.name: t for t in (GpuTier, CpuTier, DiskTier, RedisTier)}


def create_tier(name: str, config: StoreConfig | None = None, check: bool = True) -> BaseTier:
    """Build tier `name` from `config` (defaults if None).

    Raises ValueError for an unknown name and TierUnavailable when the tier cannot run
    here (`gpu` without CUDA; `redis` unreachable, probed only when `check`).
    """
    if name not in TIERS:
        raise ValueError(f"unknown store tier {name!r}; use one of {', '.join(TIERS)}")
    return TIERS[name].from_config(config or StoreConfig(), check=check)


def create_store(config: StoreConfig | None = None) -> TieredStore:
    """The tiered store of `config`: its tiers in order, its eviction policy and loaders.

    A tier that cannot run here (`gpu` without CUDA) is left out with a log line; Redis is
    not probed here but by the store, which skips it while unreachable and retries it every
    `redis_retry_s` seconds.
    """
    config = config or StoreConfig()
    tiers = []
    for name in config.tiers:
        try:
            tiers.append(create_tier(name, config, check=False))
        except TierUnavailable as exc:
            log.info("store tier %s left out: %s", name, exc)
    if not tiers:
        raise TierUnavailable(f"none of the store tiers {config.tiers} can run here")
    return TieredStore(
        tiers,
        create_policy(config.eviction),
        retry_s=config.redis_retry_s,
        load_threads=config.load_threads,
    )
