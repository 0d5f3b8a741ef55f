"""`/v1/chat/completions` holds every token budget a client sends to the server's limit,
whichever OpenAI name it uses (`max_tokens`, `max_completion_tokens`), and with both the
smaller applies (issue #50: a huge `max_tokens` beside `max_completion_tokens` got a 200)."""

from __future__ import annotations

import pytest

from tests.app.conftest import make_settings

LIMIT = make_settings(".").max_tokens_limit
HUGE = 99999999999999999999999


def chat(client, **budget):
    body = {"messages": [{"role": "user", "content": "When was the lighthouse first lit?"}]}
    body.update(mode="full", seed=1, **budget)
    return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "budget,field",
    [
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"max_completion_tokens": HUGE}, "max_completion_tokens"),
        ({"max_tokens": HUGE, "max_completion_tokens": 4}, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": HUGE}, "max_completion_tokens"),
        ({"max_tokens": LIMIT + 1, "max_completion_tokens": LIMIT}, "max_tokens"),
        ({"max_tokens": LIMIT, "max_completion_tokens": LIMIT + 1}, "max_completion_tokens"),
    ],
)
def test_every_budget_sent_is_held_to_the_limit(client, budget, field):
    response = chat(client, **budget)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (
        error["message"].startswith(f"{field} is ") and f"the limit is {LIMIT}" in error["message"]
    )


@pytest.mark.parametrize(
    "budget",
    [
        {"max_tokens": 2, "max_completion_tokens": 12},
        {"max_tokens": 12, "max_completion_tokens": 2},
    ],
)
def test_with_both_names_the_smaller_budget_applies(client, budget):
    response = chat(client, **budget)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (
        body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "length"
    )
