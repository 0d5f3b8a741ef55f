"""Alembic migrations: head matches the models, and upgrade / downgrade / upgrade round-trips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from app.catalog import Catalog, NewChunk, create_db_engine, downgrade_to_base, upgrade_to_head
from app.catalog.migrate import current_revision
from app.catalog.models import Base

REPO = Path(__file__).resolve().parents[3]
TABLES = {"documents", "chunks", "variants", "index_changes", "ingests"}


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
    assert current_revision(catalog_url) == "0003"


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
        done = subprocess.run(
            alembic + step, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
    assert _tables(catalog_url) == TABLES


def test_0002_turns_half_ingested_documents_into_expired_ingests(catalog_url):
    """A document a 0001 crash left without index rows gets an expired lease; complete ones none."""
    from alembic import command

    from app.catalog.migrate import alembic_config

    command.upgrade(alembic_config(catalog_url), "0001")
    engine = create_db_engine(catalog_url)
    with engine.begin() as connection:  # rows as a 0001 server wrote them
        for doc_id, rows in ((1, [7]), (2, [None]), (3, [])):
            connection.execute(
                text(
                    "INSERT INTO documents (id, source, content_hash, title, created_at) "
                    "VALUES (:id, 's', 'h', '', CURRENT_TIMESTAMP)"
                ),
                {"id": doc_id},
            )
            for ordinal, row in enumerate(rows):
                connection.execute(
                    text(
                        "INSERT INTO chunks (document_id, ordinal, text, num_tokens, "
                        "token_ids_hash, embedding_row, "
                        "created_at) VALUES (:d, :o, 'x', 1, 'h', :r, CURRENT_TIMESTAMP)"
                    ),
                    {"d": doc_id, "o": ordinal, "r": row},
                )
    engine.dispose()
    upgrade_to_head(catalog_url)
    catalog = Catalog(create_db_engine(catalog_url))
    try:
        expired = {i.document_id for i in catalog.expired_ingests()}
        assert expired == {2, 3}
        assert catalog.ingest_of(1) is None
    finally:
        catalog.close()


def test_concurrent_upgrades_serialise(catalog_url):
    """Several processes migrating one empty database at once all succeed (advisory lock)."""
    code = "import sys; from app.catalog import upgrade_to_head; upgrade_to_head(sys.argv[1])"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, catalog_url], cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    assert current_revision(catalog_url) == "0003" and _tables(catalog_url) == TABLES


def test_0003_reads_variants_written_before_it_as_unconditioned(catalog_url):
    """A variant row a 0002 server wrote has no lead after the upgrade (a plain variant), and
    a downgrade drops the column without touching the rows."""
    from alembic import command

    from app.catalog.migrate import alembic_config

    command.upgrade(alembic_config(catalog_url), "0002")
    catalog = Catalog(create_db_engine(catalog_url))
    catalog.add_document("a.txt", "", "a" * 64, [NewChunk("x", 1, "0" * 64)])
    catalog.close()
    engine = create_db_engine(catalog_url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO variants (chunk_id, context_signature, model_fingerprint, "
                "prefix_digest, storage_dtype, store_key, tier, num_bytes, num_tokens, status, "
                "created_at, access_count) VALUES (1, '', 'fp', 'pd', 'float16', 'k1', 'disk', "
                "8, 1, 'ready', CURRENT_TIMESTAMP, 0)"
            )
        )
    engine.dispose()
    upgrade_to_head(catalog_url)
    catalog = Catalog(create_db_engine(catalog_url))
    try:
        (variant,) = catalog.variants_of_chunk(1)
        assert variant.lead == () and not variant.is_conditioned
        assert [v.store_key for v in catalog.variant_contexts("fp", "pd")] == ["k1"]
    finally:
        catalog.close()
    command.downgrade(alembic_config(catalog_url), "0002")
    assert current_revision(catalog_url) == "0002"
