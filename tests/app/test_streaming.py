"""Streaming over real HTTP (uvicorn on loopback): `/ask` SSE and OpenAI-style chat chunks."""

from __future__ import annotations

import json

import httpx

ASK = {"question": "When was the lighthouse first lit?", "top_k": 2, "max_tokens": 8}


def sse_frames(response: httpx.Response) -> list[tuple[str, str]]:
    frames, event, data = [], "message", []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            frames.append((event, "\n".join(data)))
            event, data = "message", []
    return frames


def test_ask_streams_pieces_then_the_report(live_url):
    with httpx.Client(base_url=live_url, timeout=60) as client:
        plain = client.post("/ask", json=ASK).json()
        with client.stream("POST", "/ask", json={**ASK, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            frames = sse_frames(response)
    kinds = [kind for kind, _ in frames]
    assert len(kinds) >= 2 and kinds == ["piece"] * (len(kinds) - 1) + ["report"]
    pieces = "".join(json.loads(data)["text"] for kind, data in frames if kind == "piece")
    report = json.loads(frames[-1][1])
    assert (
        pieces and pieces == report["answer"] == plain["answer"]
    )  # greedy: same answer either way
    assert [c["chunk_id"] for c in report["chunks"]] == [c["chunk_id"] for c in plain["chunks"]]
    assert report["mode"] == plain["mode"] and report["usage"] == plain["usage"]


def test_a_stream_error_is_an_error_event(live_url, services, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(services.engine, "prefill", broken)
    with httpx.Client(base_url=live_url, timeout=60) as client:
        with client.stream("POST", "/ask", json={**ASK, "stream": True}) as response:
            frames = sse_frames(response)
    assert frames[-1][0] == "error"
    assert json.loads(frames[-1][1])["error"]["message"] == "internal server error"


def test_chat_completions_stream_in_openai_wire_format(live_url):
    """The last user message is the question: the streamed answer is `/ask`'s for it."""
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": ASK["question"]}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=live_url, timeout=60) as client:
        plain = client.post("/ask", json={"question": ASK["question"], "max_tokens": 8}).json()
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            frames = [data for _, data in sse_frames(response)]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content and content == plain["answer"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["finish_reason"]
    usage = chunks[-1]["usage"]
    assert (
        chunks[-1]["choices"] == []
        and usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    )
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
