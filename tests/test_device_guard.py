"""The device overlap guard (invariant 1 in the database, migration 0017): an update that moves a device onto
another is refused on SQLite and PostgreSQL alike, and an update that does not move it (a state, a handle) runs
no check, so on PostgreSQL it does not wait for its GPU's row, which a claim or another VM's provisioning holds.
It did, and two VMs provisioned at once with devices on the same two GPUs deadlocked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DEMO, pg_schema
from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError

from vgpu_ctl import Controller
from vgpu_ctl.store.tables import DEVICE


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ctl(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Controller]:
    def made(url: str) -> Controller:
        c = Controller(url, state_path=tmp_path / "hosts")
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        return c

    if request.param == "sqlite":
        c = made(f"sqlite:///{tmp_path / 'store.db'}")
        yield c
        c.close()
        return
    with pg_schema() as url:
        c = made(url)
        yield c
        c.close()


def _devices(ctl: Controller) -> list[tuple[str, int, int, int, str]]:
    with ctl.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(DEVICE.c.id, DEVICE.c.gpu_id, DEVICE.c.start, DEVICE.c.size,
                                                      DEVICE.c.state).order_by(DEVICE.c.start))]


def test_moving_a_device_onto_another_is_refused_and_nothing_changes(ctl: Controller) -> None:
    for name in ("a", "b"):
        ctl.request_vm("acme", name, [("A100D-10C", 1)], vcpus=1, memory_mib=1024, pool="inference",
                       provision=False)
    before = _devices(ctl)
    same_gpu = [d for d in before if d[1] == before[0][1]]
    assert len(same_gpu) == 2, before  # pack put both on one GPU
    (_, _, start, _, _), (second, *_) = same_gpu
    with pytest.raises(IntegrityError, match="overlaps"), ctl.engine.begin() as conn:
        conn.execute(update(DEVICE).where(DEVICE.c.id == second).values(start=start))
    assert _devices(ctl) == before


def test_a_device_made_ready_does_not_wait_for_its_gpu(ctl: Controller) -> None:
    ctl.request_vm("acme", "a", [("A100D-10C", 1)], vcpus=1, memory_mib=1024, pool="inference", provision=False)
    [(device, gpu, *_)] = _devices(ctl)
    with ctl.engine.connect() as holder, ctl.engine.connect() as writer:
        if ctl.engine.dialect.name != "postgresql":
            pytest.skip("SQLite locks the whole store, not rows: the guard takes no row lock there")
        holder.execute(text("SELECT 1 FROM gpu WHERE id = :id FOR UPDATE"), {"id": gpu})  # as a claim holds it
        writer.execute(text("SET lock_timeout = '2s'"))
        try:
            writer.execute(update(DEVICE).where(DEVICE.c.id == device).values(state="ready", handle={"uuid": "x"}))
        except OperationalError as exc:
            pytest.fail(f"marking a device ready waited for its GPU's row: {exc}")
        writer.commit()
        holder.rollback()
    assert _devices(ctl)[0][4] == "ready"
