"""Settings checked as a whole at start-up (#59 item 4): a setting that would make every request
fail, or that names something that does not exist, stops the start with one line naming the
variable; a `KVMOSAIC_*` variable nothing reads is named with the nearest known one."""

from __future__ import annotations

import logging
import os

import pytest
from pydantic import ValidationError

from app.cli import main
from app.cli.common import setting_errors
from app.settings import Settings
from engine.planners import Mode, planner_names


@pytest.fixture()
def clean_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVMOSAIC_")]:
        monkeypatch.delenv(name)


def refusal(monkeypatch, **variables: str) -> str:
    """The one line a start with these variables fails with."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    [line] = setting_errors(refused.value)
    return line


def test_default_mode_is_a_mode_read_once(clean_environment, monkeypatch):
    assert Settings().default_mode == Mode.named("cachecraft")
    monkeypatch.setenv("KVMOSAIC_DEFAULT_MODE", "prefix")
    assert Settings().default_mode == Mode.named("prefix")
    assert Settings(default_mode="full").default_mode.name == "full"


def test_a_misspelt_default_mode_fails_the_start(clean_environment, monkeypatch):
    line = refusal(monkeypatch, KVMOSAIC_DEFAULT_MODE="turbo")
    assert line.startswith("KVMOSAIC_DEFAULT_MODE='turbo': unknown mode 'turbo'"), line
    assert all(name in line for name in planner_names())


def test_a_default_max_tokens_above_the_limit_fails_the_start(clean_environment, monkeypatch):
    line = refusal(monkeypatch, KVMOSAIC_DEFAULT_MAX_TOKENS="999999")
    assert line.startswith("KVMOSAIC_DEFAULT_MAX_TOKENS='999999'") and "LIMIT=512" in line, line
    monkeypatch.setenv("KVMOSAIC_MAX_TOKENS_LIMIT", "999999")
    assert Settings().default_max_tokens == 999999


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_an_unknown_device_fails_the_start(clean_environment, monkeypatch, device):
    line = refusal(monkeypatch, KVMOSAIC_DEVICE=device)
    assert line.startswith("KVMOSAIC_DEVICE=") and "cpu, cuda or cuda:N" in line, line


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", " CPU "])
def test_known_devices_are_accepted(clean_environment, device):
    assert Settings(device=device).device == device.strip().lower()


def test_the_serve_command_prints_one_line_and_exits(clean_environment, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr("uvicorn.run", never)
    monkeypatch.setenv("KVMOSAIC_DEFAULT_MODE", "turbo")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmosaic: error: KVMOSAIC_DEFAULT_MODE='turbo': unknown mode")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_unknown_variable_is_named_with_the_nearest_setting(
    clean_environment, monkeypatch, caplog
):
    from app.cli.common import settings_from

    monkeypatch.setenv("KVMOSAIC_MAX_UPLODA_BYTES", "10")
    monkeypatch.setenv("KVMOSAIC_TEST_PG_HOST", "db")  # the tests' own: not warned about
    with caplog.at_level(logging.WARNING, logger="app.environment"):
        settings_from(None)
    [record] = caplog.records
    assert record.getMessage() == (
        "KVMOSAIC_MAX_UPLODA_BYTES is not a kvmosaic setting and is ignored "
        "(did you mean KVMOSAIC_MAX_UPLOAD_BYTES?)"
    )


def test_known_variables_are_not_warned_about(clean_environment, monkeypatch, caplog):
    from app.environment import known_variables, warn_unknown_variables

    environ = dict.fromkeys(known_variables(), "x")
    with caplog.at_level(logging.WARNING, logger="app.environment"):
        assert warn_unknown_variables(environ) == []
    assert "KVMOSAIC_STORE_DTYPE" in known_variables()  # the codec's former name
