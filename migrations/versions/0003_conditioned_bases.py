"""neighbour-conditioned bases: a variant's lead

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-07

`variants.lead_signature`: the ordered ids of the chunks whose openings preceded a
neighbour-conditioned base ("" for every other variant, and for every row written before).
Replicas of the old version ignore the column; their rows read as "" (no lead).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("variants") as batch:
        batch.add_column(
            sa.Column("lead_signature", sa.Text(), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("variants") as batch:
        batch.drop_column("lead_signature")
