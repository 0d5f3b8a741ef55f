"""What every answer carries and how methods are refused: `OPTIONS` and 405 with the true
`Allow` (app/middleware.py `AllowedMethodsMiddleware`), the security headers and the web
demo's Content-Security-Policy (`SecurityHeadersMiddleware`), a request id on every answer
(`RequestIdMiddleware`), the multipart upload as the OpenAPI document describes it."""

from __future__ import annotations

import re

import pytest

OPENAPI_METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


def allow_of(response) -> set[str]:
    return {m.strip() for m in response.headers["allow"].split(",")}


def test_options_and_405_name_every_documented_method(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path, operations in paths.items():
        documented = {m.upper() for m in operations if m in OPENAPI_METHODS}
        options = client.options(concrete(path))
        assert options.status_code == 204, path
        advertised = allow_of(options) - {"HEAD", "OPTIONS"}
        assert advertised == documented, (path, options.headers["allow"])
        if "PATCH" not in documented:
            patched = client.patch(concrete(path))
            assert patched.status_code == 405 and allow_of(patched) == allow_of(options), path
            assert "not allowed" in patched.json()["error"]["message"]


def test_documents_advertises_both_its_routes(client):
    response = client.put("/documents")
    assert response.status_code == 405 and {"GET", "POST"} <= allow_of(response)


def test_unknown_paths_stay_404(client):
    assert client.options("/nope").status_code == 404


@pytest.mark.parametrize("path", ["/", "/static/app.js", "/static/style.css"])
def test_the_web_demo_has_its_security_headers(client, path):
    response = client.get(path)
    assert response.status_code == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"


def test_api_answers_are_nosniff_and_unframeable(client):
    for response in (client.get("/modes"), client.get("/nope"), client.get("/docs")):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
    # Swagger UI has an inline script: no CSP there
    assert "content-security-policy" not in client.get("/docs").headers


def test_the_web_page_has_no_inline_script_or_style(client):
    """What the CSP refuses (an inline `<script>`, a `style=` attribute) is not in the page."""
    page = client.get("/").text
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page) and "<style" not in page
    assert not re.search(r"\sstyle=|\son[a-z]+=", page)


def test_a_file_part_may_be_a_plain_text_field(client, services):
    """The OpenAPI document's multipart `file` is text: sent as a plain field (curl's
    `-F file=<x.txt`), it is taken."""
    text = "Puffins nest in burrows on Skarra island."
    added = client.post("/documents", files={"file": (None, text), "title": (None, "Puffins")})
    assert added.status_code == 201, added.text
    assert added.json()["document"]["title"] == "Puffins"
    assert client.delete(f"/documents/{added.json()['document']['id']}").status_code == 204


def test_the_multipart_schema_is_what_the_server_takes(client):
    post = client.get("/openapi.json").json()["paths"]["/documents"]["post"]
    form = post["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["additionalProperties"] is False
    assert set(form["schema"]["properties"]) == {"file", "title", "kv"}
    file = form["schema"]["properties"]["file"]
    assert file["type"] == "string" and "format" not in file and file["maxLength"] == 4096


def test_every_answer_carries_a_request_id_the_client_may_choose(client):
    """A short token the client (or its proxy) sent is kept; anything else is replaced, since
    the id goes into log lines as it is."""
    ids = {client.get(path).headers["x-request-id"] for path in ("/healthz", "/nowhere", "/")}
    assert len(ids) == 3 and all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    assert (
        client.get("/healthz", headers={"X-Request-ID": "lb-42.a:b"}).headers["x-request-id"]
        == "lb-42.a:b"
    )
    for sent in ("two words", "x" * 65, "id;drop"):
        kept = client.get("/healthz", headers={"X-Request-ID": sent}).headers["x-request-id"]
        assert kept != sent and re.fullmatch(r"[0-9a-f]{16}", kept)
    refused = client.post("/ask", json={"question": ""}, headers={"X-Request-ID": "mine-1"})
    assert refused.status_code == 422 and refused.headers["x-request-id"] == "mine-1"
