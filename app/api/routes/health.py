"""`GET /healthz` (the process is up), `GET /readyz` (it can serve now), `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import ServicesDep
from app.schemas.health import Health, Readiness
from app.services import Services

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "not ready (see `checks`)"}},
)
def readyz(services: ServicesDep) -> JSONResponse:
    """Ready when the catalog answers, the index is loaded and the work queue has room.

    A store tier that is down (Redis unreachable) or cannot write (a full disk) is listed
    under `degraded`, with the write error under `write_errors`, but does not make the
    replica unready: it serves from its other tiers and recomputes the rest. The same for the
    catalog and the local index file (`catalog`, `index`): one that cannot write still
    serves what it holds; uploads and deletes are refused (507) while the catalog cannot."""
    checks = {
        "catalog": _catalog_ok(services),
        "index": services.retriever is not None,
        "queue": services.queue.can_submit(),
        "kv_reuse": services.engine.reuse_available,
    }
    ready = checks["catalog"] and checks["index"] and checks["queue"]
    stats = services.chunk_cache.tier_stats()
    tiers = {name: s["state"] for name, s in stats.items()}
    writes = {name: w.error for name, w in services.write_states().items() if w.error}
    body = {
        "ready": ready,
        "checks": checks,
        "index_rows": len(services.retriever),
        "index_cursor": services.retriever.cursor,
        "tiers": tiers,
        "degraded": [name for name, state in tiers.items() if state != "up"] + list(writes),
        "write_errors": {
            **{name: s["write_error"] for name, s in stats.items() if s["write_error"]},
            **writes,
        },
        "queue": {
            "running": services.queue.running,
            "waiting": services.queue.waiting,
            "capacity": services.queue.capacity,
        },
        "reuse_profile": _profile(services),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _profile(services: Services) -> dict[str, object]:
    """The loaded model's reuse profile: what `balanced` may blend, and where that was decided."""
    profile = services.engine.profile
    return {
        "balanced_modes": list(profile.balanced_modes),
        "exact_first": not profile.balanced_modes,
        "source": profile.source,
        "summary": profile.summary,
    }


def _catalog_ok(services: Services) -> bool:
    try:
        with services.catalog.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
