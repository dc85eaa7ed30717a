"""Alembic environment: always runs on a connection the store hands in."""

from __future__ import annotations

from alembic import context

from queue_store.schema import VERSION_TABLE, metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "insight-queue migrations run against a live database: use `insight-queue db upgrade`"
    )

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
