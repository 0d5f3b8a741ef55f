"""Catalog fixtures: a fresh SQLite file per test, and a fresh schema in the real PostgreSQL.

PostgreSQL (database `test` at 127.0.0.1:5432, trust auth, user root or postgres) gets a
unique schema per test, selected through the connection's search_path and dropped after,
so repeated runs and other test modules never see each other's tables.
"""

from __future__ import annotations

import os
import uuid

import pytest

from app.catalog import Catalog, CatalogConfig

PG_HOST = os.environ.get("KVMOSAIC_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("KVMOSAIC_TEST_PG_PORT", "5432"))
PG_DATABASE = os.environ.get("KVMOSAIC_TEST_PG_DATABASE", "test")
PG_USERS = ("root", "postgres")


def _pg_admin_connection():
    """A psycopg connection to the test database, or the reason there is none."""
    import psycopg

    errors = []
    for user in PG_USERS:
        try:
            return psycopg.connect(
                host=PG_HOST,
                port=PG_PORT,
                dbname=PG_DATABASE,
                user=user,
                connect_timeout=3,
                autocommit=True,
            ), user
        except psycopg.Error as exc:
            errors.append(f"{user}: {str(exc).strip().splitlines()[0]}")
    return None, "; ".join(errors)


@pytest.fixture
def postgres_url():
    """A URL whose connections see only a fresh schema; skipped if PostgreSQL is unreachable."""
    connection, user = _pg_admin_connection()
    if connection is None:
        pytest.skip(f"PostgreSQL not reachable at {PG_HOST}:{PG_PORT}/{PG_DATABASE} ({user})")
    schema = f"kvm_test_{uuid.uuid4().hex[:12]}"
    with connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield (
                f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{PG_DATABASE}"
                f"?options=-csearch_path%3D{schema}"
            )
        finally:
            connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request):
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def catalog(catalog_url):
    catalog = Catalog.open(CatalogConfig(url=catalog_url))
    yield catalog
    catalog.close()
