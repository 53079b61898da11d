"""Issue 9, defect 1: a VM's release (and a failed request's undo) gives back its quota and host capacity
exactly once, also when two processes delete it at the same moment, or when its create is retried by
idempotency key while it is being deleted (SQLite and PostgreSQL)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, check_store_invariants, pg_schema

from vgpu_ctl.hosts.protocol import DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service.hosts import HostFactory

pytestmark = pytest.mark.slow


class SlowHost(SimulatedHost):
    """A simulated host whose teardown takes a while, so that two releases overlap."""

    def undefine_domain(self, name: str) -> None:
        time.sleep(0.4)
        super().undefine_domain(name)

    def remove_device(self, spec: DeviceSpec) -> None:
        time.sleep(0.1)
        super().remove_device(spec)


class SlowFactory(HostFactory):
    def _open(self, host: Any) -> Any:
        return SimulatedHost(host.name, self.state_path / "hosts") if os.environ.get("FAST_HOSTS") else \
            SlowHost(host.name, self.state_path / "hosts")


def _controller(url: str, state: str) -> Any:
    os.environ["VGPU_CTL_STATE_DIR"] = state
    from vgpu_ctl import Controller
    return Controller(url, init=False, state_path=Path(state), host_factory=SlowFactory(Path(state)))


def _act(url: str, state: str, what: str, ref: str, start_at: float) -> str:
    """Delete the VM `ref`, or re-send the create of it by its idempotency key, at `start_at`."""
    from vgpu_ctl.errors import VgpuCtlError
    c = _controller(url, state)
    try:
        time.sleep(max(0.0, start_at - time.time()))
        if what == "delete":
            c.release_vm(ref)
            return "deleted"
        vm = c.request_vm("acme", "target", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference",
                          idempotency_key="target-key")
        return f"create:{vm.state}:{vm.id}"
    except VgpuCtlError as exc:
        return f"{type(exc).__name__}"
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"
    finally:
        c.close()


def _setup(url: str, state: Path) -> str:
    from vgpu_ctl import Controller
    c = Controller(url, state_path=state)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        c.create_tenant("solo")
        for name in ("keep1", "keep2"):
            c.request_vm("acme", name, [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference")
        c.request_vm("solo", "only", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference")
        return str(c.request_vm("acme", "target", [("A100D-10C", 1)], vcpus=2, memory_mib=2048,
                                pool="inference", idempotency_key="target-key").id)
    finally:
        c.close()


def _race(url: str, state: Path, jobs: list[tuple[str, str]],
          delays: tuple[float, ...] = (0.0, 0.0)) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(jobs)) as pool:
        start_at = time.time() + 4.0  # every process has opened its controller by then
        return pool.starmap(_act, [(url, str(state), what, ref, start_at + d)
                                   for (what, ref), d in zip(jobs, delays, strict=True)])


def _check(url: str, state: Path, results: list[str]) -> None:
    from sqlalchemy import text

    from vgpu_ctl.store.engine import make_engine
    assert not [r for r in results if r.startswith("error")], results
    engine = make_engine(url)
    try:
        check_store_invariants(engine)  # usage equals allocations: nothing was given back twice
        with engine.connect() as conn:
            states = {r[0]: r[1] for r in conn.execute(text("SELECT name, state FROM vm"))}
            hosts_used = conn.execute(text("SELECT sum(used_vcpus) FROM host")).scalar()
    finally:
        engine.dispose()
    assert hosts_used == 2 * sum(1 for s in states.values() if s != "failed"), (hosts_used, states)
    for host in ("kvm-a100-01", "kvm-h100-01", "kvm-l40s-01"):
        sim = SimulatedHost(host, state / "hosts")
        assert len(sim.list_domains()) <= len(states)


def _two_deletes(url: str, state: Path) -> None:
    vm_id = _setup(url, state)
    results = _race(url, state, [("delete", vm_id), ("delete", vm_id)])
    assert "deleted" in results, results
    assert set(results) <= {"deleted", "Conflict", "NotFound"}, results
    _check(url, state, results)
    # and the solo tenant, whose usage would go below 0 on a second release
    from vgpu_ctl import Controller
    c = Controller(url, state_path=state, init=False)
    only = c.get_vm("solo/only").id
    c.close()
    results = _race(url, state, [("delete", only), ("delete", only)])
    assert "deleted" in results and set(results) <= {"deleted", "Conflict", "NotFound"}, results
    _check(url, state, results)


def _delete_and_recreate(url: str, state: Path, delay: float) -> None:
    vm_id = _setup(url, state)
    results = _race(url, state, [("delete", vm_id), ("create", vm_id)], (0.0, delay))
    assert results[0] == "deleted", results
    # the create answers with the VM being deleted, or (once it is gone) makes a new one; never a VM it
    # started again while it was being torn down
    made, _, made_id = results[1].rpartition(":")
    assert made in ("create:releasing", "create:running") or results[1] == "NotFound", results
    _check(url, state, results)
    from vgpu_ctl import Controller
    c = Controller(url, state_path=state, init=False)
    try:
        vms = {v.name: v for v in c.list_vms("acme")}
    finally:
        c.close()
    if made == "create:running" and made_id != vm_id:  # made anew once the old one was gone
        assert vms["target"].id == made_id and vms["target"].state == "running"
    else:  # the VM being deleted (or, when the create came first, the VM before its delete)
        assert "target" not in vms


def test_two_deletes_of_one_vm_sqlite(tmp_path: Path, state_dir: Path) -> None:
    _two_deletes(f"sqlite:///{tmp_path / 'store.db'}", state_dir)


@pytest.mark.postgres
def test_two_deletes_of_one_vm_postgres(state_dir: Path) -> None:
    with pg_schema() as url:
        _two_deletes(url, state_dir)


@pytest.mark.parametrize("delay", [0.1, 0.45])
def test_create_by_key_while_deleting_sqlite(tmp_path: Path, state_dir: Path, delay: float) -> None:
    _delete_and_recreate(f"sqlite:///{tmp_path / 'store.db'}", state_dir, delay)


@pytest.mark.postgres
@pytest.mark.parametrize("delay", [0.1, 0.45])
def test_create_by_key_while_deleting_postgres(state_dir: Path, delay: float) -> None:
    with pg_schema() as url:
        _delete_and_recreate(url, state_dir, delay)
