"""Alembic environment: runs migrations on the engine the caller put in the config."""

from alembic import context

from vgpu_ctl.store import models

target_metadata = models.SQLModel.metadata
engine = context.config.attributes["engine"]
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
