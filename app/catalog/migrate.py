"""Run the catalog's Alembic migrations from code (no `alembic.ini` needed).

`upgrade_to_head(url)` is what the app calls at start-up; `downgrade_to_base(url)` exists
for tests and for wiping a catalog. The same migrations run from the command line with
`alembic upgrade head` at the repo root (URL from `KVMOSAIC_DATABASE_URL`).

On PostgreSQL both run under a session-level advisory lock (`MIGRATION_LOCK`), so replicas
that start at the same moment on one database migrate one after the other: the first
creates the schema, the others find it at head. On SQLite an exclusive `flock` on
`<database>.migrate.lock` does the same for processes on this machine (the only ones that
can open the file).
"""

from __future__ import annotations

import fcntl
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from app.catalog.db import create_db_engine, normalize_url
from engine.errors import KvMosaicError

# pg_advisory_lock key shared by every kvmosaic replica (arbitrary, fixed: "kvmosaic" in ASCII).
MIGRATION_LOCK = 0x6B766D6F736169

_REPO_MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def migrations_dir() -> Path:
    """The `migrations/` folder: next to `engine/` in a checkout, or the installed package."""
    if (_REPO_MIGRATIONS / "env.py").exists():
        return _REPO_MIGRATIONS
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
        if (folder / "env.py").exists():
            return folder
    raise KvMosaicError("the catalog migrations (migrations/env.py) are not installed")


def alembic_config(url: str) -> Config:
    """An Alembic config for `url`; env.py reads the URL from the `url` attribute."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["url"] = normalize_url(url)
    # Keep the app's logging setup: env.py only configures logging from an ini file.
    config.attributes["configure_logger"] = False
    return config


def upgrade_to_head(url: str) -> None:
    """Create or upgrade the catalog schema at `url` to the newest migration (serialised
    across processes on PostgreSQL)."""
    with migration_lock(url):
        command.upgrade(alembic_config(url), "head")


def downgrade_to_base(url: str) -> None:
    """Drop every catalog table at `url` (the migrations run in reverse)."""
    with migration_lock(url):
        command.downgrade(alembic_config(url), "base")


@contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold PostgreSQL's advisory lock `MIGRATION_LOCK` (waiting for it) on a connection of
    its own, or a file lock next to a SQLite file; a no-op for in-memory SQLite. Released
    when the block ends, or when the process dies, so a crashed replica never blocks others."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        with _file_lock(parsed.database):
            yield
        return
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            connection = connection.execution_options(isolation_level="AUTOCOMMIT")
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
    finally:
        engine.dispose()


@contextmanager
def _file_lock(database: str | None) -> Iterator[None]:
    if not database or database == ":memory:":
        yield
        return
    path = Path(database).with_name(Path(database).name + ".migrate.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def at_head(engine: Engine) -> bool:
    """Whether the database behind `engine` is at the newest migration (read only)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(alembic_config(str(engine.url))).get_heads()
    with engine.connect() as connection:
        return set(MigrationContext.configure(connection).get_current_heads()) == set(heads)


def current_revision(url: str) -> str | None:
    """The revision the database at `url` is at (None: not migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
