"""Settings come from KVMOSAIC_* variables, are all documented, and build the engine and store configs."""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import ENGINE_DEFAULTS, Settings, engine_settings, parse_bytes
from engine import EngineConfig
from engine.config import FIDELITIES, FIELD_BOUNDS, gradual_multipliers

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_documented_in_the_readme():
    documented = set(re.findall(r"`(KVMOSAIC_[A-Z_]+)`", README.read_text()))
    documented |= {f"KVMOSAIC_STORE_{t}_BYTES" for t in ("GPU", "CPU", "DISK", "REDIS")}  # the <TIER> row
    documented |= {"KVMOSAIC_HOST", "KVMOSAIC_PORT"}  # one row, "HOST` / `KVMOSAIC_PORT"
    missing = {f"KVMOSAIC_{name.upper()}" for name in Settings.model_fields} - documented
    assert not missing, f"undocumented settings: {sorted(missing)}"


def test_environment_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMOSAIC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("KVMOSAIC_CHECK_LAYERS", "1, 3,5")
    monkeypatch.setenv("KVMOSAIC_STORE_TIERS", "cpu,disk")
    monkeypatch.setenv("KVMOSAIC_STORE_CPU_BYTES", "512MiB")
    monkeypatch.setenv("KVMOSAIC_MODEL_PATH", "")
    monkeypatch.setenv("KVMOSAIC_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("KVMOSAIC_STORE_CODEC", "k4v3")
    s = Settings()
    assert s.check_layers == (1, 3, 5) and s.model_path is None
    assert s.admin_token.get_secret_value() == "s3cret" and "s3cret" not in repr(s)
    engine = s.engine_config()
    assert engine.check_layers == (1, 3, 5) and engine.check_ratio_multipliers == (3.0, 2.0, 1.0)
    store = s.store_config()
    assert store.tiers == ("cpu", "disk") and store.cpu_bytes == 512 << 20 and store.disk_dir == tmp_path / "kv"
    assert store.codec == "k4v3"
    assert s.catalog_config().resolved_url().endswith(f"{tmp_path}/catalog.db")


@pytest.mark.parametrize("text,value", [("1024", 1024), ("4GiB", 4 << 30), ("500MB", 500_000_000),
                                        (" 1.5 kib ", 1536)])
def test_byte_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("name,value", [("KVMOSAIC_STORE_CPU_BYTES", "lots"), ("KVMOSAIC_DEFAULT_TOP_K", "21"),
                                        ("KVMOSAIC_RECOMPUTE_RATIO", "2"), ("KVMOSAIC_WORKERS", "0")])
def test_bad_values_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()


# -- one home per default: the engine settings derive from EngineConfig --------------------------

# EngineConfig fields no KVMOSAIC_* variable sets (check_multipliers sets check_ratio_multipliers).
NOT_SETTINGS = {"system_prompt", "instruction", "selfcheck", "check_ratio_multipliers"}


@pytest.fixture()
def clean_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVMOSAIC_")]:
        monkeypatch.delenv(name)


def test_engine_settings_have_engine_config_defaults_and_types():
    hints = typing.get_type_hints(EngineConfig)
    assert set(ENGINE_DEFAULTS) - set(engine_settings()) == NOT_SETTINGS
    for name in engine_settings():
        field = Settings.model_fields[name]
        assert field.default == ENGINE_DEFAULTS[name], name
        if name != "fidelity":  # a Literal of the levels EngineConfig checks its str against
            assert field.annotation == hints[name], name
    assert typing.get_args(Settings.model_fields["fidelity"].annotation) == FIDELITIES
    # check_multipliers None means gradual filtering, EngineConfig's default at its check layers
    assert gradual_multipliers(len(EngineConfig.check_layers)) == EngineConfig.check_ratio_multipliers


def test_default_settings_build_the_default_engine_config(clean_environment):
    assert Settings().engine_config() == EngineConfig()


@pytest.mark.parametrize("name", sorted(FIELD_BOUNDS))
def test_engine_bounds_are_checked_when_the_settings_are_read(clean_environment, monkeypatch, name):
    bounds = FIELD_BOUNDS[name]
    cast = int if isinstance(ENGINE_DEFAULTS[name], int) or name in ("num_threads", "focus_layer") else float
    edges = [bounds.ge] + ([bounds.le] if bounds.le is not None else [])
    assert all(getattr(Settings(**{name: cast(edge)}), name) == cast(edge) for edge in edges)
    outside = [bounds.ge - 1] + ([bounds.le + 1] if bounds.le is not None else [])
    for value in outside:
        monkeypatch.setenv(f"KVMOSAIC_{name.upper()}", str(cast(value)))
        with pytest.raises(ValidationError, match=name):
            Settings()
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: cast(value)})


def test_cross_field_and_choice_checks_wait_for_the_engine_config(clean_environment):
    for values in ({"craft_reuse_below": 0.8, "craft_full_above": 0.7}, {"craft_build": "later"},
                   {"selection": "nearest"}, {"deviation": "query"}, {"check_layers": (2, 1)}):
        settings = Settings(**values)  # accepted as before; the engine config refuses them
        with pytest.raises(ValueError, match=next(iter(values))):
            settings.engine_config()


def test_readme_defaults_are_the_settings_defaults():
    rows = re.findall(r"^\| `KVMOSAIC_([A-Z_]+)` \| `([^`|]*)` \|", README.read_text(), flags=re.M)
    assert len(rows) > 40
    for name, documented in rows:
        default = Settings.model_fields[name.lower()].default
        if default is not None:  # None is documented in words, e.g. `<data dir>/kv`
            assert _as_documented(default, documented) == documented, name


def _as_documented(default, documented: str) -> str:
    """`default` written the way the README writes it (numbers compared by value)."""
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(str(x) for x in default)
    if isinstance(default, (int, float)) and float(default) == float(documented):
        return documented
    return str(default)
