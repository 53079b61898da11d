"""Migration 0019: a GPU write that keeps or adds to its device count must keep every device the GPU holds in
its layout (a stale plan that passed the version check once dropped another VM's device); a release, which
lowers the count before its device rows go, is not held to it. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.errors import Conflict
from vgpu_ctl.ops.doctor import diagnose


def _claimed(ctl: Any) -> dict[str, Any]:
    """A VM of acme claimed (not provisioned): its one device's GPU, profile, start and size, and the GPU row."""
    ctl.create_tenant("acme")
    vm = ctl.request_vm("acme", "held", "1g.10gb", vcpus=1, memory_mib=1024, provision=False)
    with ctl.read() as conn:
        dev = conn.execute(text("SELECT gpu_id, profile, start, size FROM device WHERE vm_id = :v"),
                           {"v": vm.id}).one()._asdict()
    return {**dev, "gpu": _gpu(ctl, dev["gpu_id"])}


def _write(ctl: Any, gpu_id: int, layout: str, device_count: int) -> None:
    with ctl.tx() as conn:
        conn.execute(text("UPDATE gpu SET layout = :l, device_count = :n, version = version + 1 WHERE id = :g"),
                     {"l": layout, "n": device_count, "g": gpu_id})


def _gpu(ctl: Any, gpu_id: int) -> dict[str, Any]:
    with ctl.read() as conn:
        return dict(conn.execute(text("SELECT version, layout, device_count, free_units FROM gpu WHERE id = :g"),
                                 {"g": gpu_id}).one()._asdict())


@pytest.mark.parametrize("grows", [False, True], ids=["same-count", "more-devices"])
def test_a_gpu_write_that_drops_a_held_device_is_refused_and_changes_nothing(ctl: Any, grows: bool) -> None:
    held = _claimed(ctl)
    slot = f"{held['profile']}@{held['start']}+{held['size']}"
    assert slot in held["gpu"]["layout"].split(";")
    stale = f"{held['profile']}@{held['start'] + held['size']}+{held['size']}"  # a plan that never saw the VM
    count = held["gpu"]["device_count"] + (1 if grows else 0)
    with pytest.raises(IntegrityError, match="GPU layout drops a device the GPU holds"):
        _write(ctl, held["gpu_id"], stale, count)
    assert _gpu(ctl, held["gpu_id"]) == held["gpu"]
    assert all(r.ok for r in diagnose(ctl))


def test_a_write_that_keeps_the_held_device_passes(ctl: Any) -> None:
    held = _claimed(ctl)
    slot = f"{held['profile']}@{held['start']}+{held['size']}"
    more = f"{held['profile']}@{held['start'] + held['size']}+{held['size']}"
    _write(ctl, held["gpu_id"], f"{slot};{more}", held["gpu"]["device_count"] + 1)
    assert _gpu(ctl, held["gpu_id"])["layout"] == f"{slot};{more}"


def test_a_release_through_the_controller_passes(ctl: Any) -> None:
    """A release writes the layout without the device (one device fewer) before the device row goes: it is not
    held to the guard, and leaves the store consistent."""
    held = _claimed(ctl)
    ctl.release_vm(ctl.list_vms("acme")[0].id)
    assert _gpu(ctl, held["gpu_id"])["device_count"] == held["gpu"]["device_count"] - 1
    assert all(r.ok for r in diagnose(ctl))


def test_a_claim_on_a_layout_that_lacks_a_device_is_refused_with_the_fix(ctl: Any) -> None:
    """A store whose GPU layout already lacks a device (drift: the stored layout shows the GPU empty, but a VM
    holds the slot at 10): a claim planned from it takes the slot at 0, which the layout lets through but the
    device row at 10 does not. The request fails with what to run, and nothing of it is written."""
    ctl.create_tenant("acme")
    a, b = (ctl.request_vm("acme", n, "A100D-10C", vcpus=1, memory_mib=1024, pool="inference", provision=False)
            for n in ("a", "b"))
    assert [(d.gpu_id, d.start) for d in a.devices + b.devices] == [(b.devices[0].gpu_id, s) for s in (0, 10)]
    ctl.release_vm(a.id)
    gpu_id = b.devices[0].gpu_id
    with ctl.tx() as conn:  # lower count: the guard does not hold a write that removes devices
        conn.execute(text("UPDATE gpu SET layout = '', device_count = 0, free_units = axis_units WHERE id = :g"),
                     {"g": gpu_id})
    before = (_gpu(ctl, gpu_id), [v.name for v in ctl.list_vms("acme")])
    with pytest.raises(Conflict, match=r"lacks a device it holds; `vgpuctl doctor` names it and `vgpuctl "
                                       r"reconcile --fix`") as err:
        ctl.request_vm("acme", "c", "A100D-10C", vcpus=1, memory_mib=1024, pool="inference", provision=False)
    assert err.value.reasons == [{"check": "gpu-occupancy", "tenant": "acme", "name": "c"}]
    assert (_gpu(ctl, gpu_id), [v.name for v in ctl.list_vms("acme")]) == before
    assert [r.name for r in diagnose(ctl) if not r.ok] == ["gpu-occupancy"]  # what the message points to
