"""`GET /healthz` (the process is up), `GET /readyz` (it can serve now), `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(services: ServicesDep) -> JSONResponse:
    """Ready when the catalog answers, the index is loaded and the work queue has room."""
    checks = {"catalog": _catalog_ok(services), "index": services.retriever is not None,
              "queue": services.queue.can_submit(), "kv_reuse": services.engine.reuse_available}
    ready = checks["catalog"] and checks["index"] and checks["queue"]
    body = {"ready": ready, "checks": checks, "index_rows": len(services.retriever),
            "queue": {"running": services.queue.running, "waiting": services.queue.waiting,
                      "capacity": services.queue.capacity}}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _catalog_ok(services) -> bool:
    try:
        with services.catalog.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
