"""Alembic migrations of the kvmosaic catalog (see `engine.catalog.migrate`)."""
