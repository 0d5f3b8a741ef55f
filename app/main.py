"""The FastAPI app factory. Heavy things (model, embedder, catalog, store) load once, in the
lifespan.

    uvicorn --factory app.main:create_app        # settings from KVMOSAIC_* variables

Tests pass ready-made `Services` (a tiny model) instead; then the app neither builds nor
closes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from app.api.deps import host_rule
from app.api.errors import install_error_handlers
from app.api.hosts import TrustedHostMiddleware
from app.api.openapi import install_openapi
from app.api.routes import ROUTERS
from app.api.routes.web import WEB_DIR
from app.environment import warn_unknown_variables
from app.middleware import (
    AllowedMethodsMiddleware,
    ErrorMiddleware,
    MetricsMiddleware,
    RequestIdMiddleware,
    SecurityHeadersMiddleware,
)
from app.services import Services
from app.settings import Settings

DESCRIPTION = (
    "RAG answers that reuse each retrieved chunk's KV cache wherever it lands in the prompt "
    "(CacheBlend / Cache-Craft). See `GET /modes` for the recompute modes."
)


def create_app(
    settings: Settings | None = None, services: Services | None = None, announce: str | None = None
) -> FastAPI:
    """`announce`: a URL to print once the server is ready (the `serve` command's)."""
    if settings is None and services is None:  # `uvicorn --factory`: read the environment here
        warn_unknown_variables()
    settings = settings or (services.settings if services else Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = services or await run_in_threadpool(Services.start, settings)
        if announce:
            engine = app.state.services.engine
            print(f"kvmosaic: ready, open {announce} ({engine.summary})", flush=True)
            if engine.dtype_hint:
                print(f"kvmosaic: {engine.dtype_hint}", flush=True)
        try:
            yield
        finally:
            if services is None:
                await run_in_threadpool(app.state.services.close)

    app = FastAPI(title="kvmosaic", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app, settings)
    app.add_middleware(ErrorMiddleware)  # inside the metrics, so they count its 500s
    app.add_middleware(AllowedMethodsMiddleware)
    app.add_middleware(TrustedHostMiddleware, rule=host_rule(settings))
    app.add_middleware(SecurityHeadersMiddleware)  # on every answer, the host check's 400 included
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app
