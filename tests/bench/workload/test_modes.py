"""Mode specs: a mode with settings, presets, and clear errors."""

from __future__ import annotations

import pytest

from bench.workload.modes import ModeSpec, parse_modes
from engine.errors import InvalidRequest


def test_settings_attach_to_the_mode_before_them():
    specs = parse_modes(
        "full, cacheblend:selection=deviation,check_layers=1, cachecraft:ratio=0.3,cacheblend"
    )
    assert [s.mode for s in specs] == ["full", "cacheblend", "cachecraft", "cacheblend"]
    assert specs[1].overrides() == {"selection": "deviation", "check_layers": "1"}
    assert specs[1].name == "cacheblend:selection=deviation,check_layers=1"
    assert specs[2].overrides() == {"recompute_ratio": "0.3"}  # the alias
    assert specs[0] == ModeSpec("full") and specs[3].name == "cacheblend"


def test_a_list_setting_in_a_spec_takes_semicolons():
    (spec,) = parse_modes("cacheblend:check_layers=1;2;6,check_multipliers=4;2;1,ratio=0.2")
    assert spec.overrides() == {
        "check_layers": "1;2;6",
        "check_multipliers": "4;2;1",
        "recompute_ratio": "0.2",
    }
    from app.settings import Settings

    engine = Settings(**spec.overrides()).engine_config()
    assert engine.check_layers == (1, 2, 6) and engine.check_ratio_multipliers == (4.0, 2.0, 1.0)


def test_preset_keeps_its_name():
    (spec,) = parse_modes("cacheblend-paper")
    assert spec.name == "cacheblend-paper"
    assert spec.mode == "cacheblend"
    assert spec.overrides() == {"selection": "deviation", "check_layers": "1", "fidelity": "fast"}


def test_the_prefix_caching_baseline_keeps_the_retrieval_order():
    """`prefix-apc` is vLLM's prefix caching whatever the server's default chunk order."""
    (spec,) = parse_modes("prefix-apc")
    assert (spec.name, spec.mode, spec.overrides()) == (
        "prefix-apc",
        "prefix",
        {"chunk_order": "retrieval"},
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("fastest", "unknown mode"),
        ("cacheblend:selektion=deviation", "not a setting"),
        ("cacheblend:selection", "expected key=value"),
        ("check_layers=1,full", "before any mode"),
        ("full,full", "named twice"),
        ("full:linear_kernel=torch", "fixed when the model loads"),
        ("cachecraft:dtype=bfloat16", "fixed when the model loads"),
    ],
)
def test_malformed_specs_are_refused(text, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_modes(text)


def _workload_options(tmp_path, *flags):
    from app.cli import build_parser
    from bench.cli.workload import workload_options

    args = build_parser().parse_args(["bench", "workload", *flags])
    return workload_options(args, tmp_path)


def test_quick_is_a_smaller_run_and_explicit_flags_win(tmp_path):
    default = _workload_options(tmp_path)
    quick = _workload_options(tmp_path, "--quick")
    assert (default.records, default.requests, default.max_tokens) == (12, 32, 32)
    assert (quick.records, quick.requests, quick.max_tokens) == (3, 12, 8)
    assert [s.name for s in quick.modes] == ["full", "cacheblend", "cachecraft"]
    assert quick.concurrency == default.concurrency == (1, 4)
    mine = _workload_options(tmp_path, "--quick", "--requests", "20", "--modes", "full,prefix")
    assert (
        mine.requests == 20
        and [s.name for s in mine.modes] == ["full", "prefix"]
        and mine.records == 3
    )
