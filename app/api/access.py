"""Who may change the knowledge base (`POST /documents`, `DELETE /documents/{id}`).

The rule, checked in this order:

1. A cross-site browser request is refused (403), whatever the settings: `Sec-Fetch-Site`
   `cross-site` / `same-site`, or an `Origin` whose host differs from the request's `Host`
   (or `Origin: null`). A multipart POST is a CORS "simple request" that any page can send
   without a preflight; without this check any web page a user visits could add documents
   that later answers retrieve.
2. A bearer token equal to `KVMOSAIC_WRITE_TOKEN` or `KVMOSAIC_ADMIN_TOKEN` is accepted.
3. With no write token set, a client on a loopback address that names a trusted `Host`
   (`HostRule.is_trusted`: a loopback name, the bound host or one in
   `KVMOSAIC_ALLOWED_HOSTS`) is accepted: the web demo and `./scripts/serve.sh` on one
   machine keep working out of the box, and nothing on the network can write. The `Host`
   test stops DNS rebinding: a foreign name resolved to 127.0.0.1 is same-origin and
   loopback, but its `Host` is the foreign name. Behind a reverse proxy on the same host
   every client looks local, so such a deployment must set a write token.
4. Anything else: 401 with `WWW-Authenticate: Bearer` when a write token is set, else 403.

What it does not do: rate limiting, per-document ownership, or guarding reads.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi import HTTPException, Request
from pydantic import SecretStr

from app.api.hosts import HostRule

REFUSED_FETCH_SITES = ("cross-site", "same-site")


def check_write_access(
    request: Request, write_token: SecretStr | None, admin_token: SecretStr | None, hosts: HostRule
) -> None:
    """Raise HTTPException (401/403) unless the request may write; see the module docstring."""
    if is_cross_site(request):
        raise HTTPException(403, "cross-site requests may not change documents")
    if bearer_matches(request.headers.get("authorization"), write_token, admin_token):
        return
    if _secret(write_token) is None:
        if request.client is not None and is_loopback(request.client.host):
            if hosts.is_trusted(request.headers.get("host")):
                return
            raise HTTPException(
                403,
                "document writes from this machine must name it as the Host (localhost, "
                "a loopback address or KVMOSAIC_ALLOWED_HOSTS): a foreign name that "
                "resolves here is a DNS rebinding attempt",
            )
        raise HTTPException(
            403,
            "document writes are open only to clients on this machine: set "
            "KVMOSAIC_WRITE_TOKEN and send it as a bearer token",
        )
    raise HTTPException(
        401, "missing or wrong write bearer token", headers={"WWW-Authenticate": "Bearer"}
    )


def is_cross_site(request: Request) -> bool:
    """True for a browser request sent by a page of another origin (Fetch Metadata, then Origin)."""
    if request.headers.get("sec-fetch-site", "").strip().lower() in REFUSED_FETCH_SITES:
        return True
    origin = request.headers.get("origin")
    if origin is None:
        return False  # not a browser, or a same-origin GET/HEAD
    host = request.headers.get("host", "")
    try:
        origin_host = urlsplit(origin.strip()).netloc
    except ValueError:
        return True
    return not origin_host or origin_host.lower() != host.strip().lower()


def bearer_matches(authorization: str | None, *tokens: SecretStr | None) -> bool:
    """True if `authorization` is `Bearer <t>` for one of the configured (non-empty) tokens."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    given_bytes = given.strip().encode()
    return any(
        hmac.compare_digest(given_bytes, secret.encode())
        for secret in (_secret(t) for t in tokens)
        if secret is not None
    )


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ::ffff:127.x.y.z; a host name (not an address) is not loopback."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _secret(token: SecretStr | None) -> str | None:
    value = token.get_secret_value() if token is not None else ""
    return value or None
