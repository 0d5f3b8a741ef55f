"""Database settings and connections for the catalog: SQLite by default, PostgreSQL by URL.

SQLite connections get WAL journaling (readers never block the writer), foreign keys on
(so deleting a document cascades to its chunks and variants) and a busy timeout (writers
from several threads wait instead of failing). A SQLite file on a full volume cannot even be
read that way (its shared-memory file cannot grow): `read_only_engine` opens a cleanly closed
one read-only instead. Sessions note whether they wrote (`wrote`), so the catalog knows when
a write worked. This module creates connections only; the schema comes from the Alembic
migrations (`app.catalog.migrate.upgrade_to_head`).
"""

from __future__ import annotations

import os
import sqlite3
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import URL, CursorResult, Delete, Engine, Update, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction, sessionmaker
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


def read_only_engine(url: str) -> Engine | None:
    """A read-only pool over the SQLite file at `url` that needs no write at all (no lock, no
    shared-memory file), for a volume that cannot take one; None unless `url` is a SQLite
    file closed cleanly (no write-ahead log left whose commits a read would miss)."""
    path = sqlite_file(url)
    if path is None or not path.exists():
        return None
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return None
    uri = f"file:{quote(str(path))}?mode=ro&immutable=1"

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(uri, uri=True, check_same_thread=False)

    return create_engine(normalize_url(url), creator=connect, future=True)


def sqlite_file(url: str | URL) -> Path | None:
    """The database file of a SQLite `url` (None: another database, or in memory)."""
    parsed = make_url(normalize_url(url) if isinstance(url, str) else url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).resolve()


def probe_write(engine: Engine) -> None:
    """One small real write that changes nothing (the migration stamp rewritten as it is):
    raises what the database says if it cannot write now."""
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = version_num"))


# `Session.info` key: the session wrote (an INSERT, UPDATE or DELETE, flushed or executed).
WROTE = "kvmosaic_wrote"


def create_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose loaded objects stay readable after commit (no lazy reload), noting in
    their `info` whether they wrote (`wrote`)."""
    factory = sessionmaker(engine, expire_on_commit=False, future=True)
    event.listen(factory, "after_flush", _flushed)
    event.listen(factory, "do_orm_execute", _executed)
    return factory


def wrote(session: Session) -> bool:
    """Whether the session sent the database a write (what its commit made durable)."""
    return bool(session.info.get(WROTE))


def _flushed(session: Session, _flush: UOWTransaction) -> None:
    # A flush of rows set to the values they had sends nothing: counting it as a write would
    # end a degraded state that no write ended (after_flush still sees the pre-flush state).
    if session.new or session.deleted or any(session.is_modified(row) for row in session.dirty):
        session.info[WROTE] = True


def _executed(state: ORMExecuteState) -> None:
    if state.is_insert or state.is_update or state.is_delete:
        state.session.info[WROTE] = True


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
