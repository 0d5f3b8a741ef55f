"""The uvicorn server `kvmosaic serve` runs: its config from the settings, with the slow-client
protection of `app/connections.py` and a file-descriptor limit that fits the connection bound.

uvicorn's own settings are used where they exist (`timeout_keep_alive`: a connection idle
between requests; `backlog`); the deadlines of a request's headers and body and the bound on
open connections are the project's (`GuardedProtocol`). uvicorn's `limit_concurrency` is left
unset: it counts slow connections too, so under a slow-client attack it would answer 503 to
every new client.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from app.connections import ConnectionLimits, guarded_protocol
from app.settings import Settings

log = logging.getLogger(__name__)

# File descriptors kept for everything but client connections: the catalog, KV files, model
# files, the listening socket, pipes of the worker threads.
RESERVED_FDS = 256


def server_config(app: ASGIApp, settings: Settings, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app` on the settings' host and port, behind the connection guard;
    `options` go to uvicorn.Config as they are (tests: `log_level`, `lifespan`)."""
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=fitting_connections(settings.max_connections),
    )
    values: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "timeout_keep_alive": settings.keep_alive_s,
        "timeout_graceful_shutdown": 10,
        **options,
    }
    return uvicorn.Config(app, http=guarded_protocol(limits), **values)


def fitting_connections(wanted: int) -> int:
    """`wanted` connections, raising the process's soft file-descriptor limit (up to the hard
    one) so that they fit beside `RESERVED_FDS`; fewer, with a WARNING, where the hard limit is
    too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", raised, exc)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fitting = max(1, soft - RESERVED_FDS)
    log.warning(
        "KVMOSAIC_MAX_CONNECTIONS=%d does not fit the open-file limit (%d, `ulimit -n`): at most "
        "%d connections; raise the hard limit to serve more",
        wanted,
        soft,
        fitting,
    )
    return fitting
