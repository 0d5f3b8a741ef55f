"""Alembic migrations of the kvmosaic catalog (see `app.catalog.migrate`)."""
