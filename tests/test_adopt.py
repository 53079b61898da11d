"""Reconcile offers to adopt a domain whose VM the store lost (issue 16): its metadata records the tenant, the
size and each device's GPU and position, so the VM is claimed again as it runs, or refused with nothing
changed; and a domain without positions is never adopted."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import check_store_invariants, store_snapshot

from vgpu_ctl import Controller
from vgpu_ctl.ops.backup import backup, restore
from vgpu_ctl.render import read_claim

DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"
VGPUCTL = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "vgpuctl")


@pytest.fixture
def acme(sqlite_url: str, state_dir: Path) -> Iterator[Controller]:
    """The demo fleet on a SQLite store (the story is `db restore` of an older backup, a SQLite command)."""
    with Controller(sqlite_url, state_path=state_dir) as ctl:
        ctl.apply_inventory(DEMO)
        ctl.create_tenant("acme")
        yield ctl


@pytest.fixture
def older(acme: Controller, tmp_path: Path) -> Path:
    """A backup taken before the VM of the test is made."""
    backup(acme, tmp_path / "older.db")
    return tmp_path / "older.db"


def _lose(ctl: Controller, older: Path) -> None:
    """The store forgets the VMs made since the backup: the admin restores it; the hosts keep their domains."""
    restore(ctl, older)


def _state(ctl: Controller) -> dict[str, Any]:
    """The store but its audit trail (a reconcile run with fix records itself)."""
    return {k: v for k, v in store_snapshot(ctl).items() if k != "events"}


def _unknown(report: Any) -> list[Any]:
    return [f for f in report.findings if f.kind == "unknown-domain"]


@pytest.mark.parametrize("profile", ["A100D-10C", "H100-1-10C", "L40S-12C", "A100-80GB"])
def test_a_lost_vm_is_adopted_as_it_runs(acme: Controller, older: Path, profile: str) -> None:
    vm = acme.request_vm("acme", "web", [(profile, 1)], vcpus=4, memory_mib=8192)
    before = [(d.gpu, d.start, d.size, d.profile) for d in vm.devices]
    _lose(acme, older)
    assert acme.list_vms() == []
    asked: list[str] = []
    report = acme.reconcile(fix=True, confirm_adopt=lambda f: asked.append(f.target) or True,
                            confirm_undefine=lambda f: pytest.fail("must not be asked to undefine"))
    (found,) = _unknown(report)
    assert asked == [found.target] and found.action == "adopt VM" and found.fixed, found.to_dict()
    again = acme.get_vm(vm.id)
    assert (again.name, again.tenant, again.state, again.vcpus, again.memory_mib) == ("web", "acme", "running", 4,
                                                                                   8192)
    assert [(d.gpu, d.start, d.size, d.profile) for d in again.devices] == before
    assert {d.uuid for d in again.devices} == {d.uuid for d in vm.devices}  # the devices the domain uses
    sums = check_store_invariants(acme.engine)
    assert sums  # usage is what the adopted VM holds
    assert acme.reconcile(fix=False).clean
    acme.release_vm(vm.id)
    assert acme.reconcile(fix=False).clean and acme.list_vms() == []
    assert any(e["action"] == "vm.adopt" for e in acme.events(limit=1000))


def test_without_a_yes_nothing_is_adopted_and_a_running_domain_stays(acme: Controller, older: Path) -> None:
    acme.request_vm("acme", "web", [("A100D-10C", 1)], vcpus=4, memory_mib=8192)
    _lose(acme, older)
    before = _state(acme)
    report = acme.reconcile(fix=True, confirm_adopt=lambda f: False, confirm_undefine=lambda f: False)
    (found,) = _unknown(report)
    assert not found.fixed and found.action == "left running (not confirmed)"
    assert _state(acme) == before


def test_an_adoption_that_cannot_be_is_refused_with_nothing_changed(acme: Controller, older: Path) -> None:
    vm = acme.request_vm("acme", "web", [("A100D-40C", 1)], vcpus=4, memory_mib=8192)
    _lose(acme, older)
    acme.set_quota("acme", {"vgpus": 0})  # the tenant's limit no longer allows it
    before = _state(acme)
    (found,) = _unknown(acme.reconcile(fix=True, confirm_adopt=lambda f: True, confirm_undefine=lambda f: False))
    assert not found.fixed and "limit" in (found.error or ""), found.to_dict()
    assert _state(acme) == before
    acme.set_quota("acme", {"vgpus": None})
    other = acme.request_vm("acme", "other", [("A100D-40C", 1)], vcpus=4, memory_mib=8192, pool="training")
    # its position went to another VM meanwhile (placement is deterministic: the same first free place)
    assert {(d.gpu, d.start) for d in other.devices} == {(d.gpu, d.start) for d in vm.devices}
    before = _state(acme)
    (found,) = _unknown(acme.reconcile(fix=True, confirm_adopt=lambda f: True, confirm_undefine=lambda f: False))
    assert not found.fixed and "does not fit" in (found.error or ""), found.to_dict()
    assert _state(acme) == before
    check_store_invariants(acme.engine)


def test_a_domain_without_positions_is_not_offered(acme: Controller) -> None:
    xml = ("<domain type='kvm'><name>old-0123abcd</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>"
           "<metadata><vgpuctl:vm xmlns:vgpuctl='https://vgpu-ctl.dev/xmlns/vm/1' tenant='acme' "
           "vm-id='0123abcd-0000-0000-0000-000000000000'><vgpuctl:device id='d' profile='A100D-10C' "
           "backing='mdev'/></vgpuctl:vm></metadata></domain>")
    assert read_claim(xml) is None


def test_the_cli_adopts_with_yes(acme: Controller, older: Path, state_dir: Path) -> None:
    vm = acme.request_vm("acme", "web", [("A100D-10C", 1)], vcpus=4, memory_mib=8192)
    _lose(acme, older)
    url = acme.engine.url.render_as_string(hide_password=False)
    done = subprocess.run([VGPUCTL, "--db", url, "reconcile", "--fix", "--adopt", "--yes", "-o", "json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert acme.get_vm(vm.id).state == "running"


def test_a_passthrough_vm_is_not_an_orphan_device(acme: Controller) -> None:
    """A whole GPU handed to a VM is its claim: reconcile found it "in use but unclaimed" and was never clean."""
    acme.request_vm("acme", "whole", [("A100-80GB", 1)], vcpus=4, memory_mib=8192)
    report = acme.reconcile(fix=False)
    assert report.clean, [f.to_dict() for f in report.findings]
