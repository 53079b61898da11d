"""Fault injection at each provisioning step (an exception, and a killed process), then reconcile:
no device without a VM, no claim without a device, usage equal to allocations."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from vgpu_ctl import Controller, HostError
from vgpu_ctl.hosts.protocol import DeviceHandle, DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.hosts import HostFactory
from vgpu_ctl.service.quotas import allocated
from vgpu_ctl.store import tables
from vgpu_ctl.store.tables import VM

DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"
STEPS = ["create_device", "define_domain", "start_domain"]


class FaultyHost(SimulatedHost):
    """A simulated host that fails at one step: raising, or killing the process after the side effect."""

    def __init__(self, name: str, state_dir: Path, step: str, kill: bool) -> None:
        super().__init__(name, state_dir)
        self.step, self.kill = step, kill

    def _maybe_fail(self, step: str) -> None:
        if step == self.step:
            if self.kill:
                os._exit(17)
            raise RuntimeError(f"injected failure at {step}")

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        if self.step == "create_device" and not self.kill:
            self._maybe_fail("create_device")
        handle = super().create_device(spec)
        self._maybe_fail("create_device") if self.kill else None
        return handle

    def define_domain(self, xml: str) -> str:
        if not self.kill:
            self._maybe_fail("define_domain")
        uuid = super().define_domain(xml)
        if self.kill:
            self._maybe_fail("define_domain")
        return uuid

    def start_domain(self, name: str) -> None:
        self._maybe_fail("start_domain")
        super().start_domain(name)


class FaultyFactory(HostFactory):
    def __init__(self, state_path: Path, step: str, kill: bool) -> None:
        super().__init__(state_path)
        self.step, self.kill = step, kill

    def _open(self, host: Any) -> Any:
        return FaultyHost(host.name, self.state_path / "hosts", self.step, self.kill)


def _controller(url: str, state: Path, step: str | None = None, kill: bool = False) -> Controller:
    factory = FaultyFactory(state, step, kill) if step else None
    return Controller(url, state_path=state, host_factory=factory)


def assert_consistent(ctl: Controller) -> None:
    """The store and the hosts agree and usage equals allocations."""
    with ctl.engine.connect() as conn:
        orphan_claims = conn.execute(select(func.count()).select_from(tables.DEVICE).outerjoin(
            VM, VM.c.id == tables.DEVICE.c.vm_id).where(VM.c.id.is_(None))).scalar()
        assert orphan_claims == 0
        for t in conn.execute(select(tables.TENANT)).all():
            actual = allocated(conn, t.id)
            for r in ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib"):
                assert t._mapping[f"{r}_used"] == actual[r], r
        store_uuids = {r[0] for r in conn.execute(select(tables.DEVICE.c.uuid))}
        for g in conn.execute(select(tables.GPU)).all():
            occ = alloc.occupancy_of(ctl.catalog, g._mapping)
            starts = sorted(r[0] for r in conn.execute(select(tables.DEVICE.c.start)
                                                       .where(tables.DEVICE.c.gpu_id == g.id)))
            assert [s.start for s in occ.slots] == starts
        hosts = conn.execute(select(tables.HOST)).all()
    on_hosts = {d.uuid for h in hosts for d in ctl.hosts.get(h).list_devices()}
    assert on_hosts == store_uuids, "every device on a host has a claim and every claim a device"


@pytest.fixture
def fault_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    url = f"sqlite:///{tmp_path / 'faults.db'}"
    ctl = _controller(url, tmp_path)
    ctl.apply_inventory(DEMO)
    ctl.create_tenant("acme")
    ctl.request_vm("acme", "keep", "A100D-20C", vcpus=2, memory_mib=4096, pool="training")
    ctl.close()
    return url, tmp_path


@pytest.mark.parametrize("step", STEPS)
def test_exception_at_each_step_undoes_the_request(fault_store: tuple[str, Path], step: str) -> None:
    url, state = fault_store
    ctl = _controller(url, state, step)
    with pytest.raises(HostError, match=f"injected failure at {step}"):
        ctl.request_vm("acme", "doomed", "H100-3-40C", vcpus=4, memory_mib=8192, pool="inference")
    vm = ctl.get_vm("acme/doomed")
    assert vm.state == "failed" and vm.devices == () and f"injected failure at {step}" in (vm.error or "")
    usage = {r["resource"]: r["used"] for r in ctl.tenant_usage("acme") if r["scope"] == "*"}
    assert usage["vgpus"] == 1 and usage["vms"] == 1  # only "keep"
    assert_consistent(_controller(url, state))


def _child(url: str, state: str, step: str) -> None:
    ctl = _controller(url, Path(state), step, kill=True)
    ctl.request_vm("acme", "crashed", "H100-3-40C", vcpus=4, memory_mib=8192, pool="inference")


@pytest.mark.parametrize("step", STEPS)
def test_killed_process_at_each_step_is_repaired_by_reconcile(fault_store: tuple[str, Path], step: str) -> None:
    url, state = fault_store
    proc = mp.get_context("spawn").Process(target=_child, args=(url, str(state), step))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 17
    ctl = _controller(url, state)
    before = ctl.reconcile(fix=False)
    assert not before.clean and before.findings
    report = ctl.reconcile(fix=True)
    assert report.clean, report.to_dict()
    assert ctl.reconcile(fix=False).clean
    assert_consistent(ctl)
    states = {v.name: v.state for v in ctl.list_vms()}
    assert states["keep"] == "running"
    # The crashed request either rolled back (mid-provisioning) or was driven to running (domain defined).
    assert states.get("crashed") in ("failed", "running")


def test_reconcile_keeps_a_device_a_domain_uses(fault_store: tuple[str, Path]) -> None:
    url, state = fault_store
    ctl = _controller(url, state)
    vm = ctl.get_vm("acme/keep")
    with ctl.tx() as conn:  # the store loses the claim, the host keeps device and domain
        conn.execute(tables.DEVICE.delete().where(tables.DEVICE.c.vm_id == vm.id))
    report = ctl.reconcile(fix=True)
    kinds = {f.kind: f for f in report.findings}
    assert kinds["orphan-device"].action == "none (in use)" and not kinds["orphan-device"].fixed
    assert vm.devices[0].uuid in {d.uuid for h in ["kvm-a100-01"] for d in
                                  SimulatedHost(h, state / "hosts").list_devices()}


def test_reconcile_removes_an_orphan_device_and_a_leaked_domain(fault_store: tuple[str, Path]) -> None:
    url, state = fault_store
    ctl = _controller(url, state)
    vm = ctl.get_vm("acme/keep")
    with ctl.tx() as conn:  # a VM the store forgot entirely (e.g. restored from an old backup)
        conn.execute(tables.DEVICE.delete().where(tables.DEVICE.c.vm_id == vm.id))
        conn.execute(VM.delete().where(VM.c.id == vm.id))
    report = ctl.reconcile(fix=True, confirm_undefine=lambda f: True)  # it runs: asked
    assert {f.kind for f in report.findings} >= {"unknown-domain", "orphan-device"}
    assert report.clean
    assert SimulatedHost("kvm-a100-01", state / "hosts").list_devices() == []
    assert SimulatedHost("kvm-a100-01", state / "hosts").list_domains() == []
