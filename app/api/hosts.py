"""Which `Host` names this server answers to: the guard against DNS rebinding.

A page on a foreign name that its DNS points at 127.0.0.1 is "same origin" to the browser
and comes from a loopback address, so origin and address checks alone let it read answers
and, with no write token, add documents. What it cannot forge is the `Host` header: the
browser sends the foreign name. So:

- `HostRule.allows(host)` — the names the server answers to at all (`TrustedHostMiddleware`,
  400 for anything else): `KVMOSAIC_ALLOWED_HOSTS` when set (`*` allows every name;
  `*.example.com` a domain and its subdomains), else the name the server is bound to
  (`KVMOSAIC_HOST`) plus `localhost` and the loopback literals. Bound to a wildcard address
  (`0.0.0.0`, `::`) with no list set, every name is answered: set the list there.
- `HostRule.is_trusted(host)` — the stricter test the loopback write rule uses
  (`app.api.access`): a name listed or bound explicitly, or a loopback name; never `*`.

The health routes (`/healthz`, `/readyz`, `/metrics`) answer any name: probes and scrapers
address a replica by its IP. It does not do TLS, proxies' `X-Forwarded-Host`, or rate limits.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "*"})
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def host_name(host_header: str) -> str | None:
    """The lowercase name of a `Host` header without its port ('[::1]:8000' -> '::1');
    None if malformed."""
    try:
        name = urlsplit("//" + host_header.strip()).hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


def is_loopback_name(name: str) -> bool:
    """`localhost` (and its subdomains, RFC 6761) or a loopback address literal."""
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostRule:
    """`patterns`: exact names or `*.domain`; `any_host`: every name is answered (see the
    module docstring)."""

    patterns: frozenset[str]
    any_host: bool = False

    @classmethod
    def create(cls, bind_host: str, allowed: Iterable[str] = ()) -> HostRule:
        """The rule for a server bound to `bind_host` with `allowed` names (empty: the default)."""
        listed = {a.strip().lower().rstrip(".") for a in allowed if a.strip()}
        bind = bind_host.strip().lower().strip("[]")
        named = set() if bind in WILDCARD_BINDS else {bind}
        any_host = "*" in listed or (not listed and not named)
        return cls(frozenset((listed - {"*"}) | named), any_host)

    def allows(self, host_header: str | None) -> bool:
        """Whether the server answers a request with this `Host` header at all."""
        return self.any_host or self.is_trusted(host_header)

    def is_trusted(self, host_header: str | None) -> bool:
        """A loopback name, or one listed or bound explicitly (a `*` list does not count)."""
        name = host_name(host_header or "")
        if name is None:
            return False
        return is_loopback_name(name) or any(_matches(name, p) for p in self.patterns)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return name == pattern[2:] or name.endswith(pattern[1:])
    return name == pattern


class TrustedHostMiddleware:
    """Answers 400 to a request whose `Host` the rule does not allow (health routes excepted)."""

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.rule.any_host or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if self.rule.allows(host):
            return await self.app(scope, receive, send)
        response = error_response(
            400,
            "unknown Host header: this server answers only to the "
            "names in KVMOSAIC_ALLOWED_HOSTS (see docs/operations.md)",
        )
        await response(scope, receive, send)
