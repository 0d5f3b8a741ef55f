"""Who may add and delete documents: the rule of app/api/access.py.

No write token: loopback clients naming a trusted Host only. A write token: it or the admin
token as a bearer. Cross-site browser requests (Sec-Fetch-Site, Origin): refused whatever the
setting. A Host the server does not know: 400 (DNS rebinding, app/api/hosts.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.main import create_app
from tests.app.conftest import ADMIN_TOKEN, LOCAL_CLIENT

WRITE_TOKEN = "test-write-token"
REMOTE_CLIENT = ("203.0.113.7", 40000)
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WRITER = {"Authorization": f"Bearer {WRITE_TOKEN}"}


@pytest.fixture(scope="module")
def app_for(services):
    """An app over the module's services with `write_token` set (or not); made once per setting."""
    apps = {}

    def make(write_token: str | None, allowed_hosts: tuple[str, ...] = ("testserver",)):
        if (write_token, allowed_hosts) not in apps:
            token = SecretStr(write_token) if write_token is not None else None
            settings = services.settings.model_copy(
                update={"write_token": token, "allowed_hosts": allowed_hosts}
            )
            apps[write_token, allowed_hosts] = create_app(
                services=dataclasses.replace(services, settings=settings)
            )
        return apps[write_token, allowed_hosts]

    return make


def write(app, client_address, headers=None, text="Gannets dive for fish at sixty miles an hour."):
    """Add a document, then delete it if that worked; the two status codes."""
    with TestClient(app, client=client_address) as client:
        added = client.post("/documents", json={"text": text}, headers=headers or {})
        if added.status_code not in (200, 201):
            return added.status_code, client.delete(
                "/documents/1", headers=headers or {}
            ).status_code
        return added.status_code, client.delete(
            f"/documents/{added.json()['document']['id']}", headers=headers or {}
        ).status_code


def test_no_write_token_opens_writes_to_loopback_only(app_for, services):
    app = app_for(None)
    assert write(app, LOCAL_CLIENT) == (201, 204)
    assert write(app, ("::1", 1)) == (201, 204)
    before = len(services.retriever)
    with TestClient(app, client=REMOTE_CLIENT) as client:
        refused = client.post("/documents", json={"text": "Remote writes are closed."})
        assert (
            refused.status_code == 403
            and "KVMOSAIC_WRITE_TOKEN" in refused.json()["error"]["message"]
        )
        assert (
            client.post("/documents", files={"file": ("a.txt", b"x", "text/plain")}).status_code
            == 403
        )
        assert client.delete("/documents/1").status_code == 403
    assert len(services.retriever) == before
    assert write(app, REMOTE_CLIENT, ADMIN) == (201, 204)  # the admin token works from anywhere


@pytest.mark.parametrize("address", [LOCAL_CLIENT, REMOTE_CLIENT])
def test_a_write_token_is_required_from_everyone_when_set(app_for, address):
    app = app_for(WRITE_TOKEN)
    assert write(app, address, WRITER) == (201, 204)
    assert write(app, address, ADMIN) == (201, 204)
    for headers in (
        None,
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {WRITE_TOKEN}"},
    ):
        with TestClient(app, client=address) as client:
            response = client.post(
                "/documents", json={"text": "No token, no write."}, headers=headers
            )
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert client.delete("/documents/1", headers=headers).status_code == 401


@pytest.mark.parametrize(
    "browser",
    [
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Origin": "http://testserver.evil.example"},
    ],
)
@pytest.mark.parametrize("write_token,auth", [(None, {}), (None, ADMIN), (WRITE_TOKEN, WRITER)])
def test_cross_site_browser_writes_are_refused_always(
    app_for, services, browser, write_token, auth
):
    before = len(services.retriever)
    with TestClient(app_for(write_token), client=LOCAL_CLIENT) as client:
        form = client.post(
            "/documents",
            files={"file": ("evil.txt", b"Injected: the answer is 42.", "text/plain")},
            headers={**browser, **auth},
        )
        assert form.status_code == 403 and "cross-site" in form.json()["error"]["message"]
        assert client.delete("/documents/1", headers={**browser, **auth}).status_code == 403
    assert len(services.retriever) == before


@pytest.mark.parametrize(
    "browser",
    [{"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"}, {"Sec-Fetch-Site": "none"}],
)
def test_same_origin_browser_writes_are_accepted(app_for, browser):
    assert write(app_for(None), LOCAL_CLIENT, browser) == (201, 204)


def test_reads_stay_open_to_everyone(app_for):
    with TestClient(app_for(WRITE_TOKEN), client=REMOTE_CLIENT) as client:
        assert client.get("/documents").status_code == 200
        assert client.get("/documents/1", headers={"Sec-Fetch-Site": "cross-site"}).status_code in (
            200,
            404,
        )


# The DNS rebinding request of issue #42: a foreign name resolved to 127.0.0.1 is both
# "same origin" and "loopback"; only its Host header gives it away.
REBIND = {
    "Host": "rebind.evil.test:8000",
    "Origin": "http://rebind.evil.test:8000",
    "Sec-Fetch-Site": "same-origin",
}


def test_a_foreign_host_is_refused_before_anything_runs(app_for, services):
    before = len(services.retriever)
    with TestClient(app_for(None), client=LOCAL_CLIENT) as client:
        added = client.post(
            "/documents",
            json={"text": "Rebound writes land here.", "title": "rebind"},
            headers=REBIND,
        )
        assert (
            added.status_code == 400
            and "KVMOSAIC_ALLOWED_HOSTS" in added.json()["error"]["message"]
        )
        assert (
            client.get("/documents", headers=REBIND).status_code == 400
        )  # reads leak answers: refused too
        assert (
            client.get("/healthz", headers=REBIND).status_code == 200
        )  # probes address replicas by IP
    assert len(services.retriever) == before


def test_the_loopback_write_rule_needs_a_trusted_host_even_when_every_host_is_answered(
    app_for, services
):
    before = len(services.retriever)
    with TestClient(app_for(None, ("*",)), client=LOCAL_CLIENT) as client:
        added = client.post(
            "/documents",
            json={"text": "Rebound writes land here.", "title": "rebind"},
            headers=REBIND,
        )
        assert added.status_code == 403 and "DNS rebinding" in added.json()["error"]["message"]
        assert client.get("/documents", headers=REBIND).status_code == 200
    assert len(services.retriever) == before
    assert write(app_for(WRITE_TOKEN, ("*",)), LOCAL_CLIENT, {**REBIND, **WRITER}) == (
        201,
        204,
    )  # a token still works


@pytest.mark.parametrize(
    "host",
    ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "kb.example.com", "docs.kb.example.com"],
)
def test_loopback_and_listed_names_may_write(app_for, host):
    app = app_for(None, ("*.kb.example.com",))
    origin = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
    assert write(app, LOCAL_CLIENT, origin) == (201, 204)
