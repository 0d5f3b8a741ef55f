"""catalog: documents, chunks, variants

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "documents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("title", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_documents"),
    )
    op.create_index("ix_documents_content_hash", "documents", ["content_hash"])

    op.create_table(
        "chunks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("token_ids_hash", sa.String(length=64), nullable=False),
        sa.Column("embedding_row", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["document_id"], ["documents.id"], ondelete="CASCADE",
                                name="fk_chunks_document_id_documents"),
        sa.PrimaryKeyConstraint("id", name="pk_chunks"),
        sa.UniqueConstraint("document_id", "ordinal", name="uq_chunks_document_ordinal"),
        sa.UniqueConstraint("embedding_row", name="uq_chunks_embedding_row"),
    )
    op.create_index("ix_chunks_document_id", "chunks", ["document_id"])
    op.create_index("ix_chunks_token_ids_hash", "chunks", ["token_ids_hash"])

    op.create_table(
        "variants",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("chunk_id", sa.Integer(), nullable=False),
        sa.Column("context_signature", sa.Text(), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("prefix_digest", sa.String(length=64), nullable=False),
        sa.Column("storage_dtype", sa.String(length=16), nullable=False),
        sa.Column("store_key", sa.String(length=64), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("access_count", sa.Integer(), nullable=False),
        sa.Column("last_access_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("a", sa.Float(), nullable=True),
        sa.Column("b", sa.Float(), nullable=True),
        sa.Column("cci", sa.Float(), nullable=True),
        sa.Column("inter_scores", sa.JSON(), nullable=True),
        sa.Column("token_scores", sa.JSON(), nullable=True),
        sa.Column("expected_savings", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["chunk_id"], ["chunks.id"], ondelete="CASCADE",
                                name="fk_variants_chunk_id_chunks"),
        sa.PrimaryKeyConstraint("id", name="pk_variants"),
        sa.UniqueConstraint("store_key", name="uq_variants_store_key"),
    )
    op.create_index("ix_variants_chunk_id", "variants", ["chunk_id"])
    op.create_index("ix_variants_status", "variants", ["status"])
    op.create_index("ix_variants_chunk_fingerprint", "variants", ["chunk_id", "model_fingerprint"])


def downgrade() -> None:
    op.drop_table("variants")
    op.drop_table("chunks")
    op.drop_table("documents")
