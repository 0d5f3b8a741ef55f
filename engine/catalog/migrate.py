"""Run the catalog's Alembic migrations from code (no `alembic.ini` needed).

`upgrade_to_head(url)` is what the app calls at start-up; `downgrade_to_base(url)` exists
for tests and for wiping a catalog. The same migrations run from the command line with
`alembic upgrade head` at the repo root (URL from `KVMOSAIC_DATABASE_URL`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config

from engine.catalog.db import normalize_url
from engine.errors import KvMosaicError

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
    """Create or upgrade the catalog schema at `url` to the newest migration."""
    command.upgrade(alembic_config(url), "head")


def downgrade_to_base(url: str) -> None:
    """Drop every catalog table at `url` (the migrations run in reverse)."""
    command.downgrade(alembic_config(url), "base")


def current_revision(url: str) -> str | None:
    """The revision the database at `url` is at (None: not migrated)."""
    from alembic.runtime.migration import MigrationContext

    from engine.catalog.db import create_db_engine

    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
