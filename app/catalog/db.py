"""Database settings and connections for the catalog: SQLite by default, PostgreSQL by URL.

SQLite connections get WAL journaling (readers never block the writer), foreign keys on
(so deleting a document cascades to its chunks and variants) and a busy timeout (writers
from several threads wait instead of failing). This module creates connections only; the
schema comes from the Alembic migrations (`app.catalog.migrate.upgrade_to_head`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import CursorResult, Delete, Engine, Update, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

URL_ENV = "KVMOSAIC_DATABASE_URL"
DATA_DIR_ENV = "KVMOSAIC_DATA_DIR"
SQLITE_BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class CatalogConfig:
    """Where the catalog lives.

    `url`: a SQLAlchemy URL, e.g. `postgresql+psycopg://user@host:5432/db` (a plain
    `postgresql://` URL is given the psycopg driver). None means the SQLite file
    `<data_dir>/catalog.db`.
    `data_dir`: the app's data directory (only used for the default SQLite file).
    `migrate`: run `alembic upgrade head` when the catalog is opened.
    `echo`: log every SQL statement (debugging).
    """

    url: str | None = None
    data_dir: Path = Path("data")
    migrate: bool = True
    echo: bool = False

    def resolved_url(self) -> str:
        return normalize_url(self.url) if self.url else default_sqlite_url(self.data_dir)


def default_sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{Path(data_dir).resolve() / 'catalog.db'}"


def url_from_environment() -> str:
    """`KVMOSAIC_DATABASE_URL`, else the SQLite file under `KVMOSAIC_DATA_DIR` (default `data`)."""
    url = os.environ.get(URL_ENV)
    return (
        normalize_url(url)
        if url
        else default_sqlite_url(Path(os.environ.get(DATA_DIR_ENV, "data")))
    )


def normalize_url(url: str) -> str:
    """Give bare `postgresql://` / `postgres://` URLs the psycopg (v3) driver."""
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            return "postgresql+psycopg://" + url[len(bare) :]
    return url


def create_db_engine(url: str, echo: bool = False) -> Engine:
    """A connection pool for `url`; creates the SQLite file's directory if needed."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True, future=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, echo=echo, future=True, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    )
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def create_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose loaded objects stay readable after commit (no lazy reload)."""
    return sessionmaker(engine, expire_on_commit=False, future=True)


class BaseCatalog(ABC):
    """What the catalog's method groups (`ingests.py`, `changes.py`) build on: transactions."""

    @abstractmethod
    def session(self) -> AbstractContextManager[Session]:
        """One transaction: committed when the block ends, rolled back (and re-raised) if it
        raises; an integrity error comes out as `CatalogError`."""


def rows_changed(s: Session, statement: Update | Delete) -> int:
    """Run an UPDATE or DELETE in `s`; the number of rows it matched."""
    result = s.execute(statement)
    # Session.execute is typed to return a plain Result, since an ORM statement need not run
    # on a cursor; an UPDATE or DELETE without RETURNING always does.
    assert isinstance(result, CursorResult)
    return result.rowcount
