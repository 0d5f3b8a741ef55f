"""scale-out: chunk embeddings, the retrieval change log, ingest leases

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Documents that a crash left half-ingested under 0001 (a chunk without an index row, or no
chunk at all) get an ingest row whose lease has already expired, so the first replica that
runs lease recovery deletes them, exactly like a crash under 0002. Stop replicas of the old
version before upgrading: a document one of them is ingesting looks the same.
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)


def upgrade() -> None:
    with op.batch_alter_table("chunks") as batch:
        batch.add_column(sa.Column("embedding", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("embedder", sa.String(length=256), nullable=True))

    op.create_table(
        "index_changes",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("chunk_id", sa.Integer(), nullable=False),
        sa.Column("op", sa.String(length=8), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_index_changes"),
    )

    ingests = op.create_table(
        "ingests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["document_id"], ["documents.id"], ondelete="CASCADE",
                                name="fk_ingests_document_id_documents"),
        sa.PrimaryKeyConstraint("id", name="pk_ingests"),
        sa.UniqueConstraint("document_id", name="uq_ingests_document_id"),
    )
    op.create_index("ix_ingests_lease_expires_at", "ingests", ["lease_expires_at"])
    _expire_half_ingested(ingests)


def _expire_half_ingested(ingests: sa.Table) -> None:
    documents = sa.table("documents", sa.column("id", sa.Integer()))
    chunks = sa.table("chunks", sa.column("document_id", sa.Integer()), sa.column("embedding_row", sa.BigInteger()))
    complete = sa.exists().where(chunks.c.document_id == documents.c.id)
    unindexed = sa.exists().where(chunks.c.document_id == documents.c.id, chunks.c.embedding_row.is_(None))
    expired = sa.literal(_EXPIRED, sa.DateTime(timezone=True))
    leftovers = sa.select(documents.c.id, sa.literal("migration-0002"), sa.literal("running"), expired, expired) \
        .where(sa.or_(~complete, unindexed))
    op.execute(ingests.insert().from_select(
        ["document_id", "owner", "state", "started_at", "lease_expires_at"], leftovers))


def downgrade() -> None:
    op.drop_index("ix_ingests_lease_expires_at", table_name="ingests")
    op.drop_table("ingests")
    op.drop_table("index_changes")
    with op.batch_alter_table("chunks") as batch:
        batch.drop_column("embedder")
        batch.drop_column("embedding")
