"""Settings come from KVMOSAIC_* variables, are all described, and build the engine and store
configs."""

from __future__ import annotations

import os
import re
import typing
from dataclasses import fields
from enum import Enum
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.cli.common import setting_errors
from app.cli.settings import literal_choices, reference
from app.settings import ENGINE_DEFAULTS, Settings, engine_settings, parse_bytes
from app.store.codec_names import Codec, VariantCodec
from app.store.codecs import CODECS
from app.store.config import KNOWN_POLICIES, KNOWN_TIERS, StoreConfig
from engine import EngineConfig
from engine.config import (
    CRAFT_BUILDS,
    DECODE_ATTENTIONS,
    DECODE_WEIGHTS,
    DEVIATIONS,
    DTYPES,
    ENCODE_DTYPES,
    FIELD_BOUNDS,
    LINEAR_KERNELS,
    REUSE_PROFILE_USES,
    SELECTIONS,
    gradual_multipliers,
)

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# The engine's choice fields: EngineConfig checks its str against the tuple, Settings types the
# field with the Literal the tuple comes from.
ENGINE_CHOICES = {
    "dtype": DTYPES,
    "encode_dtype": ENCODE_DTYPES,
    "linear_kernel": LINEAR_KERNELS,
    "decode_attention": DECODE_ATTENTIONS,
    "decode_weights": DECODE_WEIGHTS,
    "deviation": DEVIATIONS,
    "selection": SELECTIONS,
    "craft_build": CRAFT_BUILDS,
    "reuse_profile": REUSE_PROFILE_USES,
}


def test_every_setting_has_a_description():
    missing = [
        name
        for name, field in Settings.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not missing, f"settings without a description: {missing}"


def test_the_configuration_reference_is_current():
    assert CONFIGURATION.read_text() == reference(), (
        "docs/configuration.md is stale: run `.venv/bin/kvmosaic settings > docs/configuration.md`"
    )
    for name in Settings.model_fields:
        assert f"`KVMOSAIC_{name.upper()}`" in CONFIGURATION.read_text(), name


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
    assert (
        store.tiers == ("cpu", "disk")
        and store.cpu_bytes == 512 << 20
        and store.disk_dir == tmp_path / "kv"
    )
    assert store.codec == "k4v3"
    assert s.catalog_config().resolved_url().endswith(f"{tmp_path}/catalog.db")


@pytest.mark.parametrize(
    "text,value", [("1024", 1024), ("4GiB", 4 << 30), ("500MB", 500_000_000), (" 1.5 kib ", 1536)]
)
def test_byte_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "name,value",
    [
        ("KVMOSAIC_STORE_CPU_BYTES", "lots"),
        ("KVMOSAIC_DEFAULT_TOP_K", "21"),
        ("KVMOSAIC_RECOMPUTE_RATIO", "2"),
        ("KVMOSAIC_WORKERS", "0"),
    ],
)
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
        if name in ENGINE_CHOICES:  # a Literal of the values EngineConfig checks its str against
            assert typing.get_args(field.annotation) == ENGINE_CHOICES[name], name
        else:
            assert field.annotation == hints[name], name
    # check_multipliers None means gradual filtering, EngineConfig's default at its check layers
    assert (
        gradual_multipliers(len(EngineConfig.check_layers)) == EngineConfig.check_ratio_multipliers
    )


def test_default_settings_build_the_default_engine_config(clean_environment):
    assert Settings().engine_config() == EngineConfig()


@pytest.mark.parametrize("name", sorted(FIELD_BOUNDS))
def test_engine_bounds_are_checked_when_the_settings_are_read(clean_environment, monkeypatch, name):
    bounds = FIELD_BOUNDS[name]
    cast = (
        int
        if isinstance(ENGINE_DEFAULTS[name], int) or name in ("num_threads", "focus_layer")
        else float
    )
    edges = [bounds.ge] + ([bounds.le] if bounds.le is not None else [])
    assert all(getattr(Settings(**{name: cast(edge)}), name) == cast(edge) for edge in edges)
    outside = [bounds.ge - 1] + ([bounds.le + 1] if bounds.le is not None else [])
    for value in outside:
        monkeypatch.setenv(f"KVMOSAIC_{name.upper()}", str(cast(value)))
        with pytest.raises(ValidationError, match=name):
            Settings()
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: cast(value)})


def test_cross_field_checks_wait_for_the_engine_config(clean_environment):
    for values in ({"craft_reuse_below": 0.8, "craft_full_above": 0.7}, {"check_layers": (2, 1)}):
        settings = Settings(**values)  # accepted as before; the engine config refuses them
        with pytest.raises(ValueError, match=next(iter(values))):
            settings.engine_config()


@pytest.mark.parametrize(
    "name,value,allowed",
    [
        ("KVMOSAIC_DEVIATION", "query", "'value' or 'key'"),
        ("KVMOSAIC_SELECTION", "nearest", "'deviation' or 'question_weighted'"),
        ("KVMOSAIC_CRAFT_BUILD", "later", "'background' or 'inline'"),
        ("KVMOSAIC_STORE_CODEC", "fp8", "'ch4v3'"),
        ("KVMOSAIC_STORE_TIERS", "cpu,ssd", "'redis'"),
        ("KVMOSAIC_LOG_LEVEL", "loud", "'info'"),
    ],
)
def test_a_bad_choice_fails_at_start_up_naming_the_variable_and_the_choices(
    clean_environment, monkeypatch, name, value, allowed
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    [line] = setting_errors(refused.value)
    assert line.startswith(f"{name}=") and allowed in line, line


def test_choice_literals_match_what_the_configs_accept():
    assert typing.get_args(Codec) == tuple(CODECS)
    assert typing.get_args(VariantCodec) == ("auto", *CODECS)
    assert literal_choices(Settings.model_fields["store_tiers"].annotation) == KNOWN_TIERS
    assert literal_choices(Settings.model_fields["store_eviction"].annotation) == KNOWN_POLICIES


def test_store_settings_derive_from_store_config(clean_environment):
    store_fields = {f.name: f for f in fields(StoreConfig)}
    for name, field in Settings.model_fields.items():
        source = {
            "store_codec": "codec",
            "store_variant_codec": "variant_codec",
            "store_eviction": "eviction",
            "store_tiers": "tiers",
            "redis_url": "redis_url",
            "redis_prefix": "redis_prefix",
        }.get(name, name[len("store_") :] if name.startswith("store_") else "")
        if source in store_fields and source != "disk_dir":
            assert field.default == store_fields[source].default, name
            assert field.description == store_fields[source].metadata["doc"], name
    assert Settings().store_config() == StoreConfig(disk_dir=Settings().data_dir / "kv")


README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_defaults_are_the_settings_defaults():
    """The README's table of the settings people change quotes their defaults; they stay true."""
    rows = re.findall(r"^\| `KVMOSAIC_([A-Z_]+)` \| `([^`|]*)` \|", README.read_text(), flags=re.M)
    assert len(rows) >= 5
    for name, documented in rows:
        default = Settings.model_fields[name.lower()].default
        if isinstance(default, tuple):
            default = ",".join(str(x) for x in default)
        if isinstance(default, Enum):  # a typed choice: its name
            default = default.value
        assert str(default) == documented, name
