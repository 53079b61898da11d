"""Hibernation as a victim mode, and per host and profile which modes a preempted VM may be freed by.

A hibernated victim is saved by its host (libvirt managed save, here the simulated host), keeps its devices and
quota, gives back its host's vCPUs and memory, and resumes on the same devices when re-admitted; it helps a
preemptor short of host memory, never one that needs its GPU. The inventory declares the modes per host and
profile; a victim is freed by its class's mode or one keeping more of it that its host supports, and a request
no mode can make room for is refused with the reason, nothing changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_unchanged_but_refusal, check_store_invariants, store_snapshot, write_inventory
from sqlalchemy import text

from vgpu_ctl import Controller, NoCapacity
from vgpu_ctl.core.priority import PreemptionMode, victim_mode
from vgpu_ctl.errors import InventoryError
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service.hibernation import supported_modes

INVENTORY = """
pools:
  - {name: gpu}
hosts:
  - name: h1
    uri: "simulated:///h1"
    driver: simulated
    vcpus: 8
    memory_mib: 16384
    victim_modes: {MODES}
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: gpu}
      - {pci: "0000:61:00.0", model: A100-80GB, mode: passthrough, pool: gpu}
"""
ALL = '{"*": [requeue, hibernate, cancel]}'


@pytest.fixture
def make(store_url: str, state_dir: Path, tmp_path: Path) -> Any:
    made: list[Controller] = []

    def _make(modes: str = ALL) -> Controller:
        c = Controller(store_url)
        made.append(c)
        c.apply_inventory(write_inventory(tmp_path, INVENTORY.replace("{MODES}", modes)))
        s = c.scheduling
        s.create_class("batch", 10, preemptible=True, preemption_mode="hibernate")
        s.create_class("scratch", 5, preemptible=True, preemption_mode="cancel")
        s.create_class("prod", 1000)
        for t in ("acme", "beta"):
            c.create_tenant(t)
        return c
    yield _make
    for c in made:
        c.close()


def sim_domains(state_dir: Path) -> dict[str, Any]:
    """The simulated host h1's records of its domains, as its files hold them."""
    with SimulatedHost("h1", next(state_dir.rglob("h1.lock")).parent)._state(write=False) as step:
        return dict(step.state["domains"])


def sim_domain(state_dir: Path, vm: Any) -> dict[str, Any]:
    """The simulated host's record of a VM's domain."""
    return dict(sim_domains(state_dir)[f"{vm.name}-{vm.id[:8]}"])


def vm_state(ctl: Controller, name: str) -> str:
    with ctl.engine.connect() as conn:
        return str(conn.execute(text("SELECT state FROM vm WHERE name = :n"), {"n": name}).scalar())


def host_used(ctl: Controller) -> tuple[int, int]:
    with ctl.engine.connect() as conn:
        r = conn.execute(text("SELECT used_vcpus, used_memory_mib FROM host WHERE name = 'h1'")).one()
        return int(r[0]), int(r[1])


def test_hibernated_victim_frees_host_memory_keeps_devices_and_resumes(make: Any, state_dir: Path) -> None:
    ctl = make()
    low = ctl.request_vm("acme", "train", "A100D-20C", vcpus=6, memory_mib=12288, pool="gpu", priority="batch")
    # the GPU has room for another 20C; the host's memory does not (12 + 8 GiB > 16 GiB): hibernating frees it
    high = ctl.request_vm("beta", "serve", "A100D-20C", vcpus=2, memory_mib=8192, pool="gpu", priority="prod")
    assert high.state == "running"
    assert vm_state(ctl, "train") == "hibernated"
    saved = sim_domain(state_dir, low)
    assert saved["saved"] is True and saved["active"] is False  # managed save, not a shutdown
    kept = ctl.get_vm("acme/train")
    assert [d.uuid for d in kept.devices] == [d.uuid for d in low.devices]  # devices stay with it
    assert host_used(ctl) == (2, 8192)  # only serve holds the host now
    check_store_invariants(ctl.engine)
    queue = ctl.scheduling.queue()
    assert [(q["name"], q["requeued"], q["hibernated"], q["vm_id"]) for q in queue] == [("train", True, True, low.id)]
    events = ctl.events()
    assert next(e for e in events if e["action"] == "vm.preempted")["params"]["mode"] == "hibernate"
    assert ctl.scheduling.preemption_counts() == {("capacity", "hibernate"): 1}
    # room again: it resumes on its host with its devices, from the save image, with its cool-down
    ctl.release_vm("beta/serve")
    back = ctl.get_vm("acme/train")
    assert back.state == "running" and back.id == low.id
    assert [d.uuid for d in back.devices] == [d.uuid for d in low.devices]
    restored = sim_domain(state_dir, low)
    assert restored["active"] is True and restored.get("restores") == 1 and not restored.get("saved")
    assert host_used(ctl) == (6, 12288) and ctl.scheduling.queue() == []
    with ctl.engine.connect() as conn:
        row = conn.execute(text("SELECT preemptions, protected_below FROM vm_sched WHERE vm_id = :v"),
                           {"v": low.id}).one()
    assert tuple(row) == (1, 1000)
    assert any(e["action"] == "vm.resume" for e in ctl.events())
    check_store_invariants(ctl.engine)


def test_hibernation_does_not_free_gpu_room(make: Any) -> None:
    ctl = make()
    ctl.request_vm("acme", "train", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="batch")
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity, match="preempting does not help"):  # its devices would stay: no room
        ctl.request_vm("beta", "serve", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="prod")
    assert_unchanged_but_refusal(ctl, before)
    assert vm_state(ctl, "train") == "running"


def test_deleting_a_hibernated_vm_frees_everything_and_drops_its_resume(make: Any, state_dir: Path) -> None:
    ctl = make()
    ctl.request_vm("acme", "train", "A100D-20C", vcpus=6, memory_mib=12288, pool="gpu", priority="batch")
    ctl.request_vm("beta", "serve", "A100D-20C", vcpus=2, memory_mib=8192, pool="gpu", priority="prod")
    ctl.release_vm("acme/train")  # deleted while hibernated: its devices and quota go, the host is not freed twice
    check_store_invariants(ctl.engine)
    assert host_used(ctl) == (2, 8192)
    assert not any(n.startswith("train-") for n in sim_domains(state_dir))
    ctl.release_vm("beta/serve")
    assert ctl.scheduling.queue() == []
    failed = [o for o in ctl.list_operations(["failed"]) if o.request.get("name") == "train"]
    assert failed and "deleted while hibernated" in str(failed[0].error)


def test_the_host_decides_the_mode_one_keeping_more_when_the_class_mode_is_not_supported(make: Any) -> None:
    ctl = make('{"*": [requeue]}')  # no cancel here: a scratch VM is requeued instead (it keeps more)
    ctl.request_vm("acme", "tmp", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="scratch")
    ctl.request_vm("beta", "serve", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="prod")
    assert next(e for e in ctl.events() if e["action"] == "vm.preempted")["params"]["mode"] == "requeue"
    assert [q["name"] for q in ctl.scheduling.queue()] == ["tmp"]
    with pytest.raises(NoCapacity, match="preempting does not help"):  # serve is not preemptible
        ctl.scheduling.preview("acme", "x", [("A100D-80C", 1)], vcpus=1, memory_mib=1024, pool="gpu",
                               priority="prod")


def test_no_mode_fits_is_refused_with_the_reason_nothing_changed(make: Any) -> None:
    ctl = make('{"A100D-80C": [cancel], "*": [requeue, cancel]}')  # hibernate nowhere
    ctl.request_vm("acme", "train", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="batch")
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity) as err:
        ctl.request_vm("beta", "serve", "A100D-80C", vcpus=1, memory_mib=1024, pool="gpu", priority="prod")
    assert "no victim mode fits: VM train on host h1 (hibernate" in err.value.message
    assert "A100D-80C: cancel" in err.value.message
    assert err.value.reasons[-1]["unfreeable"]
    assert_unchanged_but_refusal(ctl, before)


def test_passthrough_never_hibernates(make: Any) -> None:
    ctl = make()
    ctl.request_vm("acme", "train", "A100-80GB", vcpus=6, memory_mib=12288, pool="gpu", priority="batch")
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity, match="no hibernate for a passthrough GPU"):
        ctl.request_vm("beta", "serve", "A100D-20C", vcpus=2, memory_mib=8192, pool="gpu", priority="prod")
    assert_unchanged_but_refusal(ctl, before)


def test_supported_modes_rules() -> None:
    everything = {"*": ["requeue", "hibernate", "cancel"]}
    assert supported_modes(None, ["A100D-20C"], ["mdev"], True)[0] == {PreemptionMode.REQUEUE, PreemptionMode.CANCEL}
    assert PreemptionMode.HIBERNATE in supported_modes(everything, ["A100D-20C"], ["mdev"], True)[0]
    assert PreemptionMode.HIBERNATE not in supported_modes(everything, ["A100D-20C"], ["mdev"], False)[0]
    two = {"A100D-20C": ["requeue"], "*": ["cancel", "requeue"]}  # a VM gets what all its profiles allow
    assert supported_modes(two, ["A100D-20C", "A100D-10C"], ["mdev"], True)[0] == {PreemptionMode.REQUEUE}
    assert supported_modes(everything, [], [], True)[0] == set(PreemptionMode)  # no devices: '*'
    assert victim_mode(PreemptionMode.CANCEL, {PreemptionMode.HIBERNATE}) is PreemptionMode.HIBERNATE
    assert victim_mode(PreemptionMode.HIBERNATE, {PreemptionMode.REQUEUE}) is None  # never a harsher one


def test_bad_victim_modes_in_the_inventory(make: Any, tmp_path: Path) -> None:
    ctl = make()
    before = store_snapshot(ctl)
    for modes, needle in (('{"*": [pause]}', "victim_modes"), ('{"NOPE-1": [requeue]}', "unknown profile 'NOPE-1'"),
                          ('{"*": [requeue, requeue]}', "names a mode twice")):
        with pytest.raises(InventoryError, match="victim_modes") as err:
            ctl.apply_inventory(write_inventory(tmp_path, INVENTORY.replace("{MODES}", modes), "bad.yaml"))
        assert needle in err.value.message
    assert store_snapshot(ctl) == before
    with ctl.engine.connect() as conn:
        stored = conn.execute(text("SELECT victim_modes FROM host WHERE name = 'h1'")).scalar()
    got = json.loads(stored) if isinstance(stored, str) else stored
    assert got == {"*": ["requeue", "hibernate", "cancel"]}


def test_migration_0012_down_refuses_hibernated_vms_then_goes_down_and_up(make: Any) -> None:
    from alembic import command

    from vgpu_ctl.store import migrate
    ctl = make()
    ctl.request_vm("acme", "train", "A100D-20C", vcpus=6, memory_mib=12288, pool="gpu", priority="batch")
    ctl.request_vm("beta", "serve", "A100D-20C", vcpus=2, memory_mib=8192, pool="gpu", priority="prod")
    with pytest.raises(RuntimeError, match="resume or delete train first"):
        command.downgrade(migrate.alembic_config(ctl.engine), "0011")
    assert vm_state(ctl, "train") == "hibernated"  # nothing changed
    ctl.release_vm("acme/train")
    command.downgrade(migrate.alembic_config(ctl.engine), "0011")
    with ctl.engine.connect() as conn:
        assert "borrowed" in set(conn.execute(text("SELECT * FROM vm_sched")).keys())
        assert conn.execute(text("SELECT preemption_mode FROM priority_class WHERE name = 'batch'")).scalar() \
            == "requeue"
    command.upgrade(migrate.alembic_config(ctl.engine), "head")
    with ctl.engine.connect() as conn:
        assert "borrowed" not in set(conn.execute(text("SELECT * FROM vm_sched")).keys())
    check_store_invariants(ctl.engine)
