"""Alembic environment: runs migrations on the engine the caller put in the config."""

from alembic import context
from sqlmodel import SQLModel

import vgpu_ctl.store.models  # noqa: F401  (registers the tables)

target_metadata = SQLModel.metadata
engine = context.config.attributes["engine"]
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
