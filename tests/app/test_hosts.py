"""The Host rule of app/api/hosts.py: the names a server answers to, those it trusts for writes."""

from __future__ import annotations

import pytest

from app.api.hosts import HostRule, host_name


@pytest.mark.parametrize(
    "header,name",
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("Example.COM.", "example.com"),
        ("", None),
        ("[bad", None),
    ],
)
def test_host_name(header, name):
    assert host_name(header) == name


def test_the_default_is_the_bound_name_and_loopback():
    rule = HostRule.create("kb.internal")
    assert not rule.any_host
    for host in (
        "kb.internal:8000",
        "localhost",
        "127.0.0.1:1",
        "[::1]:8000",
        "127.5.6.7",
        "a.localhost",
    ):
        assert rule.allows(host) and rule.is_trusted(host), host
    for host in ("rebind.evil.test:8000", "kb.internal.evil.test", "", None, "10.0.0.1"):
        assert not rule.allows(host), host


def test_a_wildcard_bind_answers_every_name_but_trusts_only_loopback():
    rule = HostRule.create("0.0.0.0")
    assert rule.allows("rebind.evil.test") and not rule.is_trusted("rebind.evil.test")
    assert rule.is_trusted("localhost:8000")


def test_a_list_replaces_the_bound_name_guess_and_star_trusts_nothing_more():
    rule = HostRule.create("0.0.0.0", ["*.example.com", "kb.test"])
    assert rule.allows("example.com") and rule.allows("a.b.example.com")
    assert rule.allows("KB.test:80")
    assert not rule.allows("badexample.com") and not rule.allows("other.test")
    star = HostRule.create("127.0.0.1", ["*"])
    assert star.allows("anything.test") and not star.is_trusted("anything.test")
