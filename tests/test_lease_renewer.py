"""The one lease renewer of a process: every open Renewal's lease renewed by one shared thread, leaving a
Renewal waits for nothing, a lease another holder took is renewed no more, a child after fork starts its own,
and a closing store's leases end with it."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from vgpu_ctl import Controller
from vgpu_ctl.service import leases
from vgpu_ctl.service.leases import Renewal, expiry, is_held, new_holder
from vgpu_ctl.service.ports import STORE


@pytest.fixture
def vms(ctl: Controller) -> list[Any]:
    """Three placed (unprovisioned) VMs of tenant acme, each under a lease of 1 s of its own holder."""
    ctl.create_tenant("acme")
    out = []
    for i in range(3):
        vm = ctl.request_vm("acme", f"job{i}", [("A100D-10C", 1)], vcpus=2, memory_mib=4096, provision=False)
        holder = new_holder()
        with ctl.tx() as conn:
            row = STORE.vms.vm_row(conn, vm.id)
            assert row is not None
            assert STORE.vms.retake_vm(conn, row, {"lease_holder": holder, "lease_expires": expiry(1.0)})
        out.append((vm.id, holder))
    return out


def _lease(ctl: Controller, vm_id: str) -> tuple[str | None, Any]:
    with ctl.engine.connect() as conn:
        row = STORE.vms.vm_row(conn, vm_id)
    assert row is not None
    return row.lease_holder, row.lease_expires


def _renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lease-renewer"]


def test_one_thread_renews_every_open_lease_and_leaving_waits_for_nothing(ctl: Controller,
                                                                          vms: list[Any]) -> None:
    opened = [Renewal(ctl, vm_id, holder, seconds=1.0) for vm_id, holder in vms]
    for r in opened:
        r.__enter__()
    try:
        time.sleep(2.5)  # well past the first expiry
        assert len(_renewers()) == 1
        assert all(is_held(*_lease(ctl, vm_id)) for vm_id, _ in vms)
    finally:
        began = time.perf_counter()
        for r in opened[:2]:
            r.__exit__(None, None, None)
        assert time.perf_counter() - began < 0.5  # no thread to join
    try:
        time.sleep(1.5)
        assert [is_held(*_lease(ctl, vm_id)) for vm_id, _ in vms] == [False, False, True]
    finally:
        opened[2].__exit__(None, None, None)


def test_a_lease_another_holder_took_is_renewed_no_more(ctl: Controller, vms: list[Any]) -> None:
    (vm_id, holder), other = vms[0], new_holder()
    with Renewal(ctl, vm_id, holder, seconds=1.0) as renewal:
        with ctl.tx() as conn:  # a compare-and-set takes the lease from under the renewer
            row = STORE.vms.vm_row(conn, vm_id)
            assert row is not None
            assert STORE.vms.retake_vm(conn, row, {"lease_holder": other, "lease_expires": expiry(0.2)})
        time.sleep(1.0)
        assert _lease(ctl, vm_id)[0] == other and not is_held(*_lease(ctl, vm_id))
        assert renewal not in leases._RENEWER._due


def test_closing_a_store_ends_its_leases_and_the_idle_thread(store_url: str, ctl: Controller,
                                                             vms: list[Any]) -> None:
    other = Controller(store_url)
    vm_id, holder = vms[0]
    with Renewal(other, vm_id, holder, seconds=1.0):
        assert _renewers()
        other.close()
        assert not _renewers()
        time.sleep(1.5)
        assert not is_held(*_lease(ctl, vm_id))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_after_fork_runs_its_own_renewer(ctl: Controller, vms: list[Any]) -> None:
    (vm_id, holder), (child_vm, child_holder) = vms[0], vms[1]
    with Renewal(ctl, vm_id, holder, seconds=1.0):
        pid = os.fork()
        if pid == 0:  # the child: the parent's thread and leases are not its own
            ok = leases._RENEWER._thread is None and not leases._RENEWER._due
            child = Controller(ctl.engine.url.render_as_string(hide_password=False))
            try:
                with Renewal(child, child_vm, child_holder, seconds=1.0):
                    time.sleep(2.0)
                    ok = ok and is_held(*_lease(child, child_vm)) and len(_renewers()) == 1
            finally:
                child.close()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert is_held(*_lease(ctl, vm_id))  # the parent's renewer still runs


def test_the_renewer_stops_cleanly_at_interpreter_exit(store_url: str, vms: list[Any]) -> None:
    import subprocess
    import sys
    vm_id, holder = vms[0]
    code = ("import sys, time; from vgpu_ctl import Controller; from vgpu_ctl.service.leases import Renewal; "
            "ctl = Controller(sys.argv[1]); Renewal(ctl, sys.argv[2], sys.argv[3], seconds=0.3).__enter__(); "
            "time.sleep(0.3)")  # exits with the lease open and the store not closed
    done = subprocess.run([sys.executable, "-c", code, store_url, vm_id, holder], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
