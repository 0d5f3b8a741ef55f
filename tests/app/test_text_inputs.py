"""Text that the tokenizer or the embedder cannot encode is refused with a 4xx on every text
endpoint (`/ask`, `/v1/chat/completions`, `POST /documents`), streamed or not, never a 500.

JSON lets a client send a lone surrogate (`"\\ud83d"`, a cut-off emoji), which Python decodes
into a `str` that cannot become UTF-8; NUL and the other C0 controls come through too.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Each is sent inside ordinary text: the check must find it anywhere.
UNENCODABLE = [
    "\ud83d",  # a lone high surrogate
    "\ude00",  # a lone low surrogate
    "\udfff\ud800",  # both, in the wrong order
    "\x00",  # NUL
]
WRAPPERS = [lambda bad: f"what is {bad}?", lambda bad: bad + " lighthouse", lambda bad: bad * 3]


def cases() -> list[str]:
    return [wrap(bad) for bad in UNENCODABLE for wrap in WRAPPERS]


def post_json(client, path: str, body: object):
    """The body as JSON with every non-ASCII character escaped, as a client that keeps a lone
    surrogate in a string sends it (it cannot be sent as UTF-8 bytes)."""
    raw = json.dumps(body, ensure_ascii=True).encode()
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_refused(response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.json()["error"]["message"]


@pytest.mark.parametrize("text", cases())
@pytest.mark.parametrize("stream", [False, True])
def test_ask_refuses_unencodable_text(client, text, stream):
    assert_refused(post_json(client, "/ask", {"question": text, "stream": stream}))


@pytest.mark.parametrize("text", cases())
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parts", [False, True])
def test_chat_refuses_unencodable_text(client, text, stream, parts):
    content: object = [{"type": "text", "text": text}] if parts else text
    body = {"messages": [{"role": "user", "content": content}], "stream": stream}
    assert_refused(post_json(client, "/v1/chat/completions", body))


@pytest.mark.parametrize("text", cases())
def test_documents_refuse_unencodable_text(client, text):
    before = client.get("/documents").json()["total"]
    assert_refused(post_json(client, "/documents", {"text": text}))
    assert_refused(post_json(client, "/documents", {"text": "fine text", "title": text}))
    assert client.get("/documents").json()["total"] == before


def test_the_message_names_the_character(client):
    message = post_json(client, "/ask", {"question": "cut \ud83d"}).json()["error"]["message"]
    assert "U+D83D" in message


# -- fuzz: any text around an unencodable character, on every text field of every endpoint ------

ANY_CHARACTER = st.characters(codec=None, categories=None)  # surrogates and controls included
BAD_CHARACTER = st.one_of(
    st.just("\x00"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
)


def bodies(text: str, stream: bool) -> list[tuple[str, object]]:
    """Every place a text reaches the tokenizer, the embedder or the catalog."""
    return [
        ("/ask", {"question": text, "stream": stream}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}], "stream": stream},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        ),
        ("/documents", {"text": text}),
        ("/documents", {"text": "fine text", "title": text}),
        ("/documents", {"text": "fine text", "source": text}),
    ]


@given(
    before=st.text(ANY_CHARACTER, max_size=20),
    bad=BAD_CHARACTER,
    after=st.text(ANY_CHARACTER, max_size=20),
    stream=st.booleans(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_unencodable_text_is_a_4xx_everywhere(client, before, bad, after, stream):
    text = before + bad + after
    for path, body in bodies(text, stream):
        assert_refused(post_json(client, path, body))
    files = {"file": ("notes.txt", text.encode("utf-8", "surrogatepass"), "text/plain")}
    assert 400 <= client.post("/documents", files=files).status_code < 500
