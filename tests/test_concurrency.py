"""Several processes requesting and releasing VMs at once against one store (SQLite file, PostgreSQL):
afterwards no limit is passed, no two devices overlap, every GPU's layout mirrors its devices, usage equals
allocations, hosts' used vCPUs equal their VMs, and nothing leaked on the simulated hosts."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, check_store_invariants, pg_schema

pytestmark = pytest.mark.slow

PROFILES = {
    "inference": ["A100D-10C", "1g.10gb", "2g.20gb", "3g.40gb", "H100-1-10C", "1g.20gb"],
    "training": ["A100D-20C", "A100D-40C", "A100D-80C", "A100-80GB", "1g.10gb", "H100-2-20C", "4g.40gb"],
    "workstations": ["L40S-4C", "L40S-8C", "L40S-12C", "L40S-24C", "L40S-48C"],
}
TENANTS = ["t0", "t1", "t2"]


def _setup(url: str) -> None:
    from vgpu_ctl import Controller
    c = Controller(url)
    c.apply_inventory(DEMO)
    for t in TENANTS:
        c.create_tenant(t)
    c.set_quota("t0", {"vms": 5, "vgpus": 6})
    c.set_quota("t1", {"framebuffer_mib": 100 * 1024, "profile:1g.10gb": 2})
    c.set_quota("t1", {"vms": 2}, pool="workstations")
    c.set_quota("t2", {"vcpus": 24, "profile:L40S-8C": 1})
    c.set_quota("t2", {"vgpus": 2}, pool="inference")
    c.close()


def worker(url: str, state: str, index: int, ops: int, seed: int) -> dict[str, Any]:
    """One process: `ops` random requests and releases; returns what happened."""
    os.environ["VGPU_CTL_STATE_DIR"] = state
    from vgpu_ctl import Controller, NoCapacity, QuotaExceeded
    rng = random.Random(seed)
    c = Controller(url, init=False)
    live: list[str] = []
    out: dict[str, Any] = {"ok": 0, "quota": 0, "capacity": 0, "released": 0, "errors": []}
    try:
        for i in range(ops):
            if live and rng.random() < 0.4:
                vm = live.pop(rng.randrange(len(live)))
                try:
                    c.release_vm(vm)
                    out["released"] += 1
                except Exception as exc:
                    out["errors"].append(f"release: {type(exc).__name__}: {exc}")
                continue
            pool = rng.choice(sorted(PROFILES))
            vgpus = [(rng.choice(PROFILES[pool]), 1) for _ in range(rng.choice([1, 1, 1, 2]))]
            try:
                vm_info = c.request_vm(rng.choice(TENANTS), f"w{index}-{i}", vgpus, pool=pool,
                                       vcpus=rng.choice([1, 2, 4, 8]), memory_mib=rng.choice([1024, 8192]))
                live.append(vm_info.id)
                out["ok"] += 1
            except QuotaExceeded:
                out["quota"] += 1
            except NoCapacity:
                out["capacity"] += 1
            except Exception as exc:
                out["errors"].append(f"request: {type(exc).__name__}: {exc}")
    finally:
        c.close()
    return out


def warm(_: int) -> None:
    """Import what a request needs, so that the timed calls start together."""
    time.sleep(0.5)  # keep this process busy so that each one gets a task
    import vgpu_ctl.service.controller  # noqa: F401


def same_key(url: str, state: str, start_at: float) -> str:
    """Request one VM with a fixed idempotency key at (about) the same moment as the other processes."""
    os.environ["VGPU_CTL_STATE_DIR"] = state
    from vgpu_ctl import Controller
    c = Controller(url, init=False)
    try:
        time.sleep(max(0.0, start_at - time.time()))
        return c.request_vm("t0", "dup", [("A100D-10C", 1)], vcpus=1, memory_mib=1024,
                            idempotency_key="same-key-1").id
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"
    finally:
        c.close()


def _check_hosts_match_store(url: str, state: Path) -> None:
    """Every device and domain on the simulated hosts belongs to a VM in the store, and the other way round."""
    from sqlalchemy import text

    from vgpu_ctl.hosts.simulated import SimulatedHost
    from vgpu_ctl.store.engine import make_engine
    engine = make_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT h.name AS host, d.uuid FROM device d JOIN gpu g ON g.id = d.gpu_id "
                                 "JOIN host h ON h.id = g.host_id")).all()
        vms = conn.execute(text("SELECT h.name AS host, v.id FROM vm v JOIN host h ON h.id = v.host_id "
                                "WHERE v.state <> 'failed'")).all()
        states = {r[0] for r in conn.execute(text("SELECT state FROM vm"))}
    engine.dispose()
    assert states <= {"running"}, states
    for host in ("kvm-a100-01", "kvm-h100-01", "kvm-l40s-01"):
        sim = SimulatedHost(host, state / "hosts")
        assert {d.uuid for d in sim.list_devices()} == {r.uuid for r in rows if r.host == host}, host
        assert {d.uuid for d in sim.list_domains()} == {r.id for r in vms if r.host == host}, host


def _run(url: str, state: Path, processes: int, ops: int) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        results = pool.starmap(worker, [(url, str(state), i, ops, 1000 + i) for i in range(processes)])
    return results


def _check(url: str, state: Path, results: list[dict[str, Any]]) -> None:
    from vgpu_ctl.store.engine import make_engine
    errors = [e for r in results for e in r["errors"]]
    assert errors == [], errors[:5]
    total = {k: sum(r[k] for r in results) for k in ("ok", "quota", "capacity", "released")}
    assert total["ok"] > 20 and total["quota"] > 0 and total["released"] > 10, total
    engine = make_engine(url)
    try:
        check_store_invariants(engine)
    finally:
        engine.dispose()
    _check_hosts_match_store(url, state)


def _idempotency_race(url: str, state: Path, processes: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pool.map(warm, range(processes), chunksize=1)  # every process started and vgpu_ctl imported
        start_at = time.time() + 1.0
        ids = pool.starmap(same_key, [(url, str(state), start_at)] * processes, chunksize=1)
    assert len(set(ids)) == 1 and not ids[0].startswith("error"), ids
    from sqlalchemy import text

    from vgpu_ctl.store.engine import make_engine
    engine = make_engine(url)
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM vm WHERE idempotency_key = 'same-key-1'")).scalar()
    engine.dispose()
    assert n == 1


def test_many_processes_sqlite(tmp_path: Path, state_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _setup(url)
    results = _run(url, state_dir, processes=8, ops=50)
    _check(url, state_dir, results)


def test_same_idempotency_key_sqlite(tmp_path: Path, state_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _setup(url)
    _idempotency_race(url, state_dir, processes=4)
    check_store_invariants_at(url)


@pytest.mark.postgres
def test_many_processes_postgres(state_dir: Path) -> None:
    with pg_schema() as url:
        _setup(url)
        results = _run(url, state_dir, processes=4, ops=50)
        _check(url, state_dir, results)


@pytest.mark.postgres
def test_same_idempotency_key_postgres(state_dir: Path) -> None:
    with pg_schema() as url:
        _setup(url)
        _idempotency_race(url, state_dir, processes=4)
        check_store_invariants_at(url)


def check_store_invariants_at(url: str) -> None:
    from vgpu_ctl.store.engine import make_engine
    engine = make_engine(url)
    try:
        check_store_invariants(engine)
    finally:
        engine.dispose()
