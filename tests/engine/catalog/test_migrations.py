"""Alembic migrations: head matches the models, and upgrade / downgrade / upgrade round-trips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from engine.catalog import Catalog, NewChunk, create_db_engine, downgrade_to_base, upgrade_to_head
from engine.catalog.migrate import current_revision
from engine.catalog.models import Base

REPO = Path(__file__).resolve().parents[3]
TABLES = {"documents", "chunks", "variants"}


def _tables(url: str) -> set[str]:
    engine = create_db_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list:
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()


def test_head_matches_models(catalog_url):
    upgrade_to_head(catalog_url)
    assert _schema_diff(catalog_url) == []
    assert current_revision(catalog_url) == "0001"


def test_upgrade_downgrade_upgrade_round_trip(catalog_url):
    upgrade_to_head(catalog_url)
    catalog = Catalog(create_db_engine(catalog_url))
    catalog.add_document("a.txt", "", "a" * 64, [NewChunk("x", 1, "0" * 64)])
    catalog.close()
    downgrade_to_base(catalog_url)
    assert _tables(catalog_url) == set()
    assert current_revision(catalog_url) is None
    upgrade_to_head(catalog_url)
    assert _tables(catalog_url) == TABLES
    catalog = Catalog(create_db_engine(catalog_url))
    assert catalog.stats().num_documents == 0  # the downgrade really dropped the data
    catalog.close()
    upgrade_to_head(catalog_url)  # idempotent at head


def test_alembic_command_line(catalog_url):
    """`alembic upgrade head` / `downgrade base` at the repo root, URL from the environment."""
    env = dict(os.environ, KVMOSAIC_DATABASE_URL=catalog_url)
    alembic = [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini")]
    for step in (["upgrade", "head"], ["downgrade", "base"], ["upgrade", "head"]):
        done = subprocess.run(alembic + step, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert _tables(catalog_url) == TABLES
