"""The official `openai` client works against the server, streaming and not."""

from __future__ import annotations

import openai

QUESTION = "How long does the Guillemot ferry take?"


def client_for(live_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_models_and_a_completion(live_url):
    client = client_for(live_url)
    model = client.models.list().data[0].id
    assert model.startswith("kvmosaic/")
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "ignored"}, {"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        extra_body={"mode": "cacheblend", "top_k": 2},
    )
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 6
    report = completion.model_extra["kvmosaic"]
    assert len(report["chunks"]) == 2 and report["chunks"][0]["document"] == "The Guillemot ferry"


def test_streaming_matches_the_plain_answer(live_url):
    client = client_for(live_url)
    plain = client.chat.completions.create(
        model="kvmosaic", messages=[{"role": "user", "content": QUESTION}], max_tokens=6
    )
    stream = client.chat.completions.create(
        model="kvmosaic",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == plain.choices[0].message.content


def test_errors_surface_as_openai_errors(live_url):
    client = client_for(live_url)
    try:
        client.chat.completions.create(
            model="kvmosaic",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"mode": "turbo"},
        )
    except openai.UnprocessableEntityError as exc:
        assert "unknown mode 'turbo'" in exc.message
    else:
        raise AssertionError("expected a 422")
