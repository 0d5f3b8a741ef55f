"""Settings come from KVMOSAIC_* variables, are all documented, and build the engine and store configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, parse_bytes

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
    s = Settings()
    assert s.check_layers == (1, 3, 5) and s.model_path is None
    assert s.admin_token.get_secret_value() == "s3cret" and "s3cret" not in repr(s)
    engine = s.engine_config()
    assert engine.check_layers == (1, 3, 5) and engine.check_ratio_multipliers == (3.0, 2.0, 1.0)
    store = s.store_config()
    assert store.tiers == ("cpu", "disk") and store.cpu_bytes == 512 << 20 and store.disk_dir == tmp_path / "kv"
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
