"""Sources: markdown titles, recursive directories, benchmark JSON, and clear errors."""

from __future__ import annotations

import json

import pytest

from retrieval.sources import SourceError, load_sources


def test_markdown_title_and_directory_walk(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("# Tide Mills\n\nThey ground grain.")
    (tmp_path / "sub" / "a_note.txt").write_text("Plain text.")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    docs = list(load_sources([tmp_path]))
    assert [(d.title, d.text) for d in docs] == [
        ("Tide Mills", "# Tide Mills\n\nThey ground grain."),
        ("a note", "Plain text."),
    ]


def test_benchmark_json_gives_one_document_per_passage(tmp_path):
    data = [
        {
            "question": "q",
            "answers": ["a"],
            "ctxs": [{"title": "T1", "text": "one"}, {"title": "T2", "text": " "}],
        },
        {"question": "q2", "answers": [], "ctxs": [{"title": "T3", "text": "three"}]},
    ]
    path = tmp_path / "set.json"
    path.write_text(json.dumps(data))
    assert [(d.title, d.text) for d in load_sources([path])] == [("T1", "one"), ("T3", "three")]


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.txt", b"\xff\xfe not utf-8", "not valid UTF-8"),
        ("bad.json", b"{not json", "invalid JSON"),
        ("bad.pdf", b"%PDF", "not a .txt, .md or .json"),
    ],
)
def test_unreadable_sources_raise(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SourceError, match=message):
        list(load_sources([path]))


def test_missing_path_raises(tmp_path):
    with pytest.raises(SourceError, match="(?i)no such file"):
        list(load_sources([tmp_path / "nope.md"]))
