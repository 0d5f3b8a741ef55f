"""Alembic environment of the catalog.

The database URL comes, in order, from: the `url` attribute of the Config passed in (what
`app.catalog.migrate` sets), `sqlalchemy.url` in the ini file, `KVMOSAIC_DATABASE_URL`,
else the SQLite file `<KVMOSAIC_DATA_DIR or data>/catalog.db`. SQLite runs in batch mode so
later migrations can alter tables.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from app.catalog.db import create_db_engine, normalize_url, url_from_environment
from app.catalog.models import Base

config = context.config
if config.config_file_name and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    return normalize_url(url) if url else url_from_environment()


def run_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    url = database_url()
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=url.startswith("sqlite"),
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
