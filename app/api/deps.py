"""FastAPI dependencies: the services built in the lifespan, the settings, the admin and write
guards."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from app.api.access import check_write_access
from app.api.hosts import HostRule
from app.services import Services
from app.settings import Settings


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services  # set in the lifespan (`app.main`)
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_settings(services: ServicesDep) -> Settings:
    return services.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def require_admin(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Bearer token from settings; with no token configured admin is closed (403), never open."""
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        raise HTTPException(
            403, "admin endpoints are disabled: set KVMOSAIC_ADMIN_TOKEN to enable them"
        )
    scheme, _, given = (authorization or "").partition(" ")
    expected = settings.admin_token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise HTTPException(
            401, "missing or wrong admin bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


AdminDep = Depends(require_admin)


def require_writer(request: Request, settings: SettingsDep) -> None:
    """Document writes: the access rule of `app.api.access` (write or admin token, loopback
    with a trusted Host)."""
    check_write_access(request, settings.write_token, settings.admin_token, host_rule(settings))


def host_rule(settings: Settings) -> HostRule:
    """The `Host` names `settings` trust (`app.api.hosts`)."""
    return HostRule.create(settings.host, settings.allowed_hosts)


WriterDep = Depends(require_writer)
