"""Helpers of the replica tests: a fresh PostgreSQL database, a Redis prefix, a tiny model on
disk, and `kvmosaic serve` processes on loopback ports that share them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.app.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
KVMOSAIC = str(Path(sys.executable).parent / "kvmosaic")
PG_HOST = os.environ.get("KVMOSAIC_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("KVMOSAIC_TEST_PG_PORT", "5432"))
PG_ADMIN_DATABASE = os.environ.get("KVMOSAIC_TEST_PG_DATABASE", "test")
REDIS_URL = os.environ.get("KVMOSAIC_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@contextmanager
def fresh_database():
    """`postgresql+psycopg://…/kvm_scaleout_<random>`, created empty and dropped after (or None,
    with the reason, if PostgreSQL is unreachable)."""
    import psycopg

    for user in ("root", "postgres"):
        try:
            admin = psycopg.connect(
                host=PG_HOST,
                port=PG_PORT,
                dbname=PG_ADMIN_DATABASE,
                user=user,
                connect_timeout=3,
                autocommit=True,
            )
            break
        except psycopg.Error as exc:
            reason = str(exc).strip().splitlines()[0]
    else:
        yield None, reason
        return
    name = f"kvm_scaleout_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}", None
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@contextmanager
def redis_prefix():
    """A private key prefix in the real Redis, deleted after (None + reason if unreachable)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        yield None, str(exc)
        return
    prefix = f"kvmosaic-scaleout:{uuid.uuid4().hex[:12]}:"
    try:
        yield prefix, None
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def save_tiny_checkpoint(tokenizer, directory: Path) -> Path:
    """The tests' tiny random-weight Llama as a Hugging Face checkpoint `kvmosaic serve` can
    load."""
    from tests.conftest import build_tiny_model

    build_tiny_model(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@dataclass
class Replica:
    """One `kvmosaic serve` process; `env` holds its KVMOSAIC_* settings."""

    name: str
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        log = open(Path(self.env["KVMOSAIC_DATA_DIR"]) / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            [KVMOSAIC, "serve", "--port", str(self.port)],
            cwd=REPO,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout: float = 240.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=5)
                if response.status_code == 200:
                    return response.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not ready after {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def log(self) -> str:
        path = Path(self.env["KVMOSAIC_DATA_DIR"]) / f"{self.name}.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def ask(self, question: str, top_k: int = 3) -> dict:
        response = httpx.post(
            f"{self.url}/ask",
            json={"question": question, "top_k": top_k, "max_tokens": 1, "mode": "cacheblend"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return response.json()

    def ready(self) -> dict:
        return httpx.get(f"{self.url}/readyz", timeout=10).json()

    def redis_hits(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(
            r'kvmosaic_cache_lookups_total\{result="hit",tier="redis"\} ([0-9.e+]+)', text
        )
        return float(match.group(1)) if match else 0.0


def replica_env(
    data_dir: Path, database_url: str, prefix: str, model_dir: Path, **extra: str
) -> dict[str, str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "KVMOSAIC_DATA_DIR": str(data_dir),
        "KVMOSAIC_DATABASE_URL": database_url,
        "KVMOSAIC_STORE_TIERS": "cpu,redis",
        "KVMOSAIC_REDIS_URL": REDIS_URL,
        "KVMOSAIC_REDIS_PREFIX": prefix,
        "KVMOSAIC_MODEL_PATH": str(model_dir),
        "KVMOSAIC_INDEX_POLL_S": "0.2",
        "KVMOSAIC_CHUNK_TOKENS": "48",
        "KVMOSAIC_CHUNK_OVERLAP": "8",
        "KVMOSAIC_DEFAULT_MAX_TOKENS": "1",
        "KVMOSAIC_WORKERS": "1",
        "KVMOSAIC_NUM_THREADS": "1",
        "KVMOSAIC_DEFAULT_MODE": "cacheblend",
        "KVMOSAIC_LOG_LEVEL": "warning",
        "KVMOSAIC_MAX_UPLOAD_BYTES": "4000000",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env
