"""Inputs found by fuzzing and by hand that once gave 5xx; the OpenAPI document they are checked
against.

Out-of-range integers reach 64-bit database columns and torch's generator, long multipart
titles reach bounded catalog columns, deep JSON reaches the parser's recursion limit, and an
unexpected error must answer a JSON 500 without dropping the keep-alive connection.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlsplit

import pytest

from tests.app.conftest import ADMIN_TOKEN

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOO_BIG = 1 << 64
TOO_SMALL = -(1 << 63) - 1


def refused(response, status: int = 422) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


@pytest.mark.parametrize("seed", [TOO_BIG, 1 << 63, TOO_SMALL])
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_seed_is_422_on_ask_and_chat(client, seed, stream):
    assert "seed" in refused(
        client.post("/ask", json={"question": "ok?", "seed": seed, "stream": stream})
    )
    chat = {"messages": [{"role": "user", "content": "ok?"}], "seed": seed, "stream": stream}
    assert "seed" in refused(client.post("/v1/chat/completions", json=chat))


def test_extreme_in_range_seeds_answer(client):
    for seed in ((1 << 63) - 1, -(1 << 63)):
        response = client.post(
            "/ask",
            json={
                "question": "ok?",
                "seed": seed,
                "max_tokens": 1,
                "top_k": 1,
                "temperature": 1.0,
                "mode": "full",
            },
        )
        assert response.status_code == 200, response.text


def test_a_top_p_below_float_precision_still_samples(client):
    body = {
        "question": "ok?",
        "top_p": 5e-324,
        "temperature": 1.0,
        "max_tokens": 2,
        "top_k": 1,
        "mode": "full",
    }
    assert client.post("/ask", json=body).status_code == 200


@pytest.mark.parametrize(
    "path", [f"/documents/{1 << 63}", f"/documents/{TOO_BIG}", "/documents/0", "/documents/-1"]
)
def test_out_of_range_document_ids_are_422(client, path):
    refused(client.get(path))
    refused(client.delete(path))


def test_out_of_range_offset_is_422(client):
    assert "offset" in refused(client.get("/documents", params={"offset": 1 << 63}))
    assert client.get("/documents", params={"offset": (1 << 63) - 1}).json()["documents"] == []


@pytest.mark.parametrize(
    "body,field",
    [
        ({"chunk_id": 1 << 63}, "chunk_id"),
        ({"chunk_id": False}, "chunk_id"),
        ({"chunk_id": "3"}, "chunk_id"),
        ({"bytes": TOO_BIG}, "bytes"),
        ({"bytes": 1.5}, "bytes"),
    ],
)
def test_bad_evict_integers_are_422(client, body, field):
    assert field in refused(client.post("/admin/evict", json=body, headers=AUTH))


@pytest.mark.parametrize(
    "body,field",
    [
        ({"explain": 0}, "explain"),
        ({"stream": "yes"}, "stream"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": "7"}, "seed"),
        ({"temperature": False}, "temperature"),
        ({"ratio": False}, "ratio"),
        ({"top_p": True}, "top_p"),
        ({"ratio": "0.5"}, "ratio"),
    ],
)
def test_ask_types_are_strict(client, body, field):
    assert field in refused(client.post("/ask", json={"question": "ok?", **body}))


def test_chat_types_are_strict(client):
    chat = {"messages": [{"role": "user", "content": "ok?"}]}
    assert "stream" in refused(client.post("/v1/chat/completions", json={**chat, "stream": 1}))
    assert "top_k" in refused(client.post("/v1/chat/completions", json={**chat, "top_k": False}))
    for field in ("ratio", "temperature", "top_p"):  # booleans are not numbers (issue #42)
        assert field in refused(client.post("/v1/chat/completions", json={**chat, field: False}))


def test_long_multipart_title_or_file_name_is_422(client, services):
    before = len(services.retriever)
    files = {"file": ("notes.txt", b"Some notes about gulls.", "text/plain")}
    assert "title" in refused(client.post("/documents", files=files, data={"title": "t" * 1001}))
    long_name = {"file": ("n" * 300 + ".txt", b"Some notes about gulls.", "text/plain")}
    assert "file name" in refused(client.post("/documents", files=long_name))
    assert len(services.retriever) == before


def test_a_huge_first_heading_is_cut_to_the_title_limit(client):
    text = "# " + "Gull " * 400 + "\n\nGulls nest on the roofs of the harbour sheds every spring."
    response = client.post("/documents", json={"text": text})
    assert response.status_code == 201, response.text
    document = response.json()["document"]
    assert len(document["title"]) == 1000
    assert client.delete(f"/documents/{document['id']}").status_code == 204


@pytest.mark.parametrize("path", ["/documents", "/ask", "/v1/chat/completions"])
def test_deeply_nested_json_is_400(client, path):
    deep = (
        b"[" * 20_000 + b"]" * 20_000
    )  # far past the parser's recursion limit, under the size cap
    response = client.post(path, content=deep, headers={"Content-Type": "application/json"})
    refused(response, 400)


def _raw_get(sock: socket.socket, host: str, path: str) -> bytes:
    """One HTTP/1.1 GET on an open keep-alive socket; the whole response (Content-Length framed)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_an_unexpected_error_is_a_logged_json_500_and_the_connection_stays_usable(
    live_url, services, monkeypatch, caplog
):
    def broken(*args, **kwargs):
        raise RuntimeError("catalog exploded")

    monkeypatch.setattr(services.catalog, "list_documents", broken)
    host = urlsplit(live_url).netloc
    address = (urlsplit(live_url).hostname, urlsplit(live_url).port)
    with caplog.at_level(logging.ERROR), socket.create_connection(address, timeout=30) as sock:
        first = _raw_get(sock, host, "/documents")
        assert first.startswith(b"HTTP/1.1 500") and b'"internal server error"' in first
        assert b"catalog exploded" not in first and b"connection: close" not in first.lower()
        second = _raw_get(sock, host, "/healthz")  # same socket: it must still be open
        assert second.startswith(b"HTTP/1.1 200")
    logged = [r for r in caplog.records if r.exc_info and "catalog exploded" in str(r.exc_info[1])]
    assert logged, "the 500 was not logged with its traceback"


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_openapi_document_is_complete(client):
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for ref in set(_refs(document)):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    post = document["paths"]["/documents"]["post"]
    assert {"400", "401", "403", "413", "415", "422"} <= set(post["responses"])
    assert {"404", "422"} <= set(document["paths"]["/documents/{document_id}"]["get"]["responses"])
    for status in ("400", "413", "422"):
        assert post["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorBody"
        )
    assert "HTTPValidationError" not in schemas  # every 422 is documented in our error shape
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        "text/plain"
    }
    ask = schemas["AskRequest"]["properties"]
    assert ask["explain"]["type"] == "boolean"
