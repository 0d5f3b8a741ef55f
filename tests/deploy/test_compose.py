"""deploy/compose.yaml, checked statically (Docker cannot run here): `docker compose config`
where the compose plugin exists, and always a structural check of the YAML: N replicas behind
nginx on PostgreSQL and Redis, health checks, volumes, and settings the server really reads.
The same topology runs for real, without Docker, in tests/app/test_replicas.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
LONG_RUNNING = ("postgres", "redis", "kvmosaic", "nginx")
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def interpolate(value):
    """Compose's `${VAR:-default}` / `${VAR:?message}` / `${VAR}`, with no variables set."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(
        r"\$\{(\w+)(?::([-?])([^}]*))?\}",
        lambda m: m.group(3) if m.group(2) == "-" else f"<{m.group(1)}>",
        value,
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


def test_topology(compose):
    services = compose["services"]
    assert set(LONG_RUNNING) <= set(services)
    assert int(services["kvmosaic"]["deploy"]["replicas"]) >= 2
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["nginx"]["image"].startswith("nginx:")
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dependency, rule in service.get("depends_on", {}).items():
            assert dependency in services and rule["condition"] in CONDITIONS, (name, dependency)
    assert (
        services["kvmosaic"]["depends_on"]["init"]["condition"] == "service_completed_successfully"
    )
    assert (
        DEPLOY / services["init"]["build"]["context"] / services["init"]["build"]["dockerfile"]
    ).is_file()


def test_health_checks_and_volumes(compose):
    services = compose["services"]
    for name in LONG_RUNNING:
        check = services[name]["healthcheck"]
        assert check["test"] and check["test"][0] in ("CMD", "CMD-SHELL"), name
    assert "/readyz" in " ".join(services["kvmosaic"]["healthcheck"]["test"])
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).is_file(), (name, source)
            else:
                assert source in declared, (name, source)
    assert {"pgdata", "redisdata"} <= declared


def test_replicas_share_postgres_and_redis_with_settings_the_server_reads(compose):
    from app.settings import Settings

    env = compose["services"]["kvmosaic"]["environment"]
    assert compose["services"]["init"]["environment"] == env
    assert (
        env["KVMOSAIC_DATABASE_URL"].startswith("postgresql+psycopg://")
        and "@postgres:5432/" in env["KVMOSAIC_DATABASE_URL"]
    )
    assert "redis" in env["KVMOSAIC_STORE_TIERS"].split(",") and env[
        "KVMOSAIC_REDIS_URL"
    ].startswith("redis://redis:")
    fields = set(Settings.model_fields)
    unknown = [k for k in env if k.removeprefix("KVMOSAIC_").lower() not in fields]
    assert not unknown, f"settings the server does not read: {unknown}"
    settings = Settings(
        **{k.removeprefix("KVMOSAIC_").lower(): v for k, v in env.items() if "<" not in v}
    )
    assert settings.store_redis_bytes < 7 * 2**30  # below Redis' maxmemory (7gb)
    redis_command = compose["services"]["redis"]["command"]
    assert redis_command[redis_command.index("--maxmemory-policy") + 1] == "noeviction"


def test_nginx_balances_over_the_replicas():
    conf = (DEPLOY / "nginx.conf").read_text()
    assert re.search(r"upstream kvmosaic \{[^}]*server kvmosaic:8000 resolve", conf)
    assert "proxy_pass http://kvmosaic;" in conf and "proxy_buffering off;" in conf


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_config():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker has no compose plugin here")
    env = {**os.environ, "KVMOSAIC_ADMIN_TOKEN": "a", "KVMOSAIC_WRITE_TOKEN": "w"}
    done = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
