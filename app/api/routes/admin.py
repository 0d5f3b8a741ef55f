"""`/admin` (bearer token): store and catalog statistics, eviction, clearing the KV cache."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import AdminDep, ServicesDep
from app.api.errors import documented
from app.schemas.admin import AdminStats, EvictRequest, EvictResult, TierStats

router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[AdminDep], responses=documented(401, 403, 422)
)


@router.get("/stats", response_model=AdminStats)
def stats(services: ServicesDep) -> AdminStats:
    catalog = services.catalog.stats()
    tiers = {
        name: TierStats(**s, hit_rate=_rate(s["hits"], s["misses"]))
        for name, s in services.chunk_cache.tier_stats().items()
    }
    return AdminStats(
        tiers=tiers,
        documents=catalog.num_documents,
        chunks=catalog.num_chunks,
        variants={"ready": catalog.num_variants_ready, "missing": catalog.num_variants_missing},
        requests=services.counters.snapshot(services.queue),
        mean_recompute_share=services.counters.mean_recompute_share(),
        index_rows=len(services.retriever),
        model=services.model_name,
        reuse_available=services.engine.reuse_available,
    )


@router.post("/evict", response_model=EvictResult, responses=documented(400))
def evict(body: EvictRequest, services: ServicesDep) -> EvictResult:
    """Evict by tier, by chunk, and/or until `bytes` are freed by `policy` (pinned entries stay)."""
    entries, freed = services.chunk_cache.evict(
        tier=body.tier, chunk_id=body.chunk_id, policy=body.policy, num_bytes=body.bytes
    )
    return EvictResult(evicted_entries=entries, freed_bytes=freed)


@router.delete("/cache", response_model=EvictResult)
def clear_cache(services: ServicesDep) -> EvictResult:
    """Drop every cached KV; chunks are recomputed (and cached again) on their next use."""
    entries, freed = services.chunk_cache.clear()
    if services.trimmer is not None:  # the freed KV is a large block of heap: give it back now
        services.trimmer.trim_now()
    return EvictResult(evicted_entries=entries, freed_bytes=freed)


def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None
