"""Bad input gets a 4xx with a clear JSON error, and nothing is written."""

from __future__ import annotations

import pytest


def error(response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"question": ""}, "question"),
        ({"question": "   \n  "}, "question is empty"),
        ({"question": "x" * 301}, "limit is 300"),
        ({"question": "ok?", "top_k": 0}, "top_k"),
        ({"question": "ok?", "top_k": 21}, "top_k"),
        ({"question": "ok?", "mode": "turbo"}, "unknown mode 'turbo'; known modes: full"),
        ({"question": "ok?", "ratio": 1.5}, "ratio"),
        ({"question": "ok?", "max_tokens": 0}, "max_tokens"),
        ({"question": "ok?", "max_tokens": 65}, "limit is 64"),
        ({"question": "ok?", "temperature": -1}, "temperature"),
        ({"question": "ok?", "surprise": 1}, "surprise"),
        ({"top_k": 3}, "question"),
        ({"question": 42}, "question"),
    ],
)
def test_bad_ask_is_422(client, body, needle):
    assert needle in error(client.post("/ask", json=body), 422)


def test_malformed_json_is_400(client):
    response = client.post(
        "/ask", content=b'{"question": "unterminated', headers={"Content-Type": "application/json"}
    )
    assert "not valid JSON" in error(response, 400)


def test_bad_chat_request_is_422_in_openai_shape(client):
    message = error(client.post("/v1/chat/completions", json={"model": "x", "messages": []}), 422)
    assert "messages" in message
    no_user = {"messages": [{"role": "system", "content": "be nice"}]}
    assert "question is empty" in error(client.post("/v1/chat/completions", json=no_user), 422)


def test_unknown_route_and_method(client):
    error(client.get("/nope"), 404)
    error(client.get("/ask"), 405)


def documents_count(client) -> int:
    return client.get("/documents").json()["total"]


@pytest.mark.parametrize(
    "kwargs,status,needle",
    [
        (dict(json={"text": "x" * 5000}), 413, "larger than the limit of 4096 bytes"),
        (dict(json={"text": "   "}), 422, "empty"),
        (dict(json={"title": "no text"}), 422, "text"),
        (dict(json={"text": "ok", "extra": 1}), 422, "extra"),
        (
            dict(content=b"{oops", headers={"Content-Type": "application/json"}),
            400,
            "not valid JSON",
        ),
        (dict(content=b"plain", headers={"Content-Type": "text/plain"}), 415, "application/json"),
        (
            dict(files={"file": ("big.txt", b"y" * 5000, "text/plain")}),
            413,
            "larger than the limit",
        ),
        (
            dict(
                files={
                    "file": ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "text/plain")
                }
            ),
            422,
            "not valid UTF-8",
        ),
        (
            dict(files={"file": ("doc.pdf", b"%PDF-1.4", "application/pdf")}),
            415,
            "only UTF-8 .txt and .md",
        ),
        (
            dict(files={"other": ("a.txt", b"hello", "text/plain")}),
            422,
            "unknown form field 'other'",
        ),
        (dict(files={"title": (None, "only a title")}), 422, "no 'file' part"),
        (
            dict(
                files=[
                    ("file", ("a.txt", b"hello", "text/plain")),
                    ("title", (None, "a")),
                    ("title", (None, "b")),
                ]
            ),
            422,
            "once",
        ),
        (dict(json={"text": "nul \x00 byte"}), 422, "NUL"),
    ],
)
def test_bad_uploads_write_nothing(client, services, kwargs, status, needle):
    before, rows = documents_count(client), len(services.retriever)
    assert needle in error(client.post("/documents", **kwargs), status)
    assert documents_count(client) == before and len(services.retriever) == rows


def test_missing_documents_are_404(client):
    assert "no document 999999" in error(client.get("/documents/999999"), 404)
    error(client.delete("/documents/999999"), 404)
    error(client.get("/documents/not-a-number"), 422)


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/ask", b'{"question": "bad \\ud800 surrogate?"}'),
        ("/documents", b'{"text": "bad \\ud800 surrogate"}'),
    ],
)
def test_lone_surrogates_are_422(client, path, raw):
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert "lone surrogate U+D800" in error(response, 422)
