"""Several processes preempting at once for the same room (SQLite file, PostgreSQL): one high-priority request
wins, the others are refused; the victim is released and requeued exactly once; the invariants hold."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
from conftest import DEMO, check_store_invariants, pg_schema
from sqlalchemy import text


def _setup(url: str) -> None:
    from vgpu_ctl import Controller
    with Controller(url) as c:
        c.apply_inventory(DEMO)
        c.scheduling.create_class("batch", 10, preemptible=True)
        c.scheduling.create_class("prod", 1000)
        for t in ("acme", "beta"):
            c.create_tenant(t)
        c.request_vm("acme", "train", "A100-80GB", vcpus=4, memory_mib=8192, pool="training", priority="batch")


def warm(_: int) -> None:
    """Import vgpu_ctl in the worker before the race starts."""
    import vgpu_ctl.service.controller  # noqa: F401


def racer(url: str, state: str, index: int, start_at: float) -> str:
    """One process: ask for the whole GPU at prod priority at `start_at`; what happened."""
    os.environ["VGPU_CTL_STATE_DIR"] = state
    from vgpu_ctl import Controller
    from vgpu_ctl.errors import VgpuCtlError
    with Controller(url, init=False) as c:
        time.sleep(max(0.0, start_at - time.time()))
        try:
            vm = c.request_vm("beta", f"serve{index}", "A100-80GB", vcpus=4, memory_mib=8192, pool="training",
                              priority="prod")
            return f"ok {vm.state}"
        except VgpuCtlError as exc:
            return f"refused {exc.code}"


def _race(url: str, state: Path, processes: int = 3) -> None:
    _setup(url)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pool.map(warm, range(processes), chunksize=1)
        start_at = time.time() + 1.0
        results = pool.starmap(racer, [(url, str(state), i, start_at) for i in range(processes)], chunksize=1)
    assert sorted(results) == ["ok running"] + ["refused no_capacity"] * (processes - 1), results
    from vgpu_ctl.store.engine import make_engine
    engine = make_engine(url)
    try:
        check_store_invariants(engine)
        with engine.connect() as conn:
            queued = conn.execute(text("SELECT request FROM operation WHERE state = 'pending'")).all()
            names = [r[0]["name"] if isinstance(r[0], dict) else r[0] for r in queued]
            vms = sorted(r[0] for r in conn.execute(text("SELECT name FROM vm")))
    finally:
        engine.dispose()
    assert len(queued) == 1 and "train" in str(names), names  # requeued exactly once
    assert len(vms) == 1 and vms[0].startswith("serve"), vms


def test_preemption_race_sqlite(tmp_path: Path, state_dir: Path) -> None:
    _race(f"sqlite:///{tmp_path / 'store.db'}", state_dir)


@pytest.mark.postgres
def test_preemption_race_postgres(state_dir: Path) -> None:
    with pg_schema() as url:
        _race(url, state_dir)


