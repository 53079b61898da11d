"""Placing, claiming and releasing VMs with vGPUs on the demo fleet (simulated hosts), on SQLite and
PostgreSQL: lifecycle, dry runs, geometry rules, filters, refusal reasons, bad requests, idempotency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, assert_unchanged_but_refusal, check_store_invariants, store_snapshot, write_inventory

from vgpu_ctl import Conflict, Controller, InvalidInput, NoCapacity, NotFound, Placement, VmInfo
from vgpu_ctl.hosts.simulated import SimulatedHost


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def gpu(ctl: Controller, host: str, pci: str) -> dict[str, Any]:
    h = next(h for h in ctl.inventory()["hosts"] if h["name"] == host)
    return next(g for g in h["gpus"] if g["pci"] == pci)


def host_info(ctl: Controller, host: str) -> dict[str, Any]:
    return next(h for h in ctl.inventory()["hosts"] if h["name"] == host)


def req(ctl: Controller, name: str, profile: str | list[tuple[str, int]], tenant: str = "acme", vcpus: int = 2,
        memory_mib: int = 4096, **kw: Any) -> Any:
    vgpus = [(profile, 1)] if isinstance(profile, str) else profile
    return ctl.request_vm(tenant, name, vgpus, vcpus=vcpus, memory_mib=memory_mib, **kw)


# -- lifecycle --------------------------------------------------------------------------------------------------


def test_request_and_release_lifecycle(acme: Controller, state_dir: Path) -> None:
    ctl = acme
    vm = req(ctl, "web-1", "A100D-10C", vcpus=8, memory_mib=16384)
    assert isinstance(vm, VmInfo)
    assert (vm.tenant, vm.name, vm.state, vm.host, vm.pool) == ("acme", "web-1", "running", "kvm-a100-01", "inference")
    assert vm.simulated and vm.error is None and vm.domain_uuid
    assert len(vm.devices) == 1
    dev = vm.devices[0]
    assert (dev.gpu, dev.profile, dev.kind, dev.start, dev.size, dev.state, dev.backing) == \
        ("kvm-a100-01/0000:81:00.0", "A100D-10C", "vgpu", 0, 10, "ready", "mdev")
    assert vm.framebuffer_mib == 10240

    sim = SimulatedHost("kvm-a100-01", state_dir / "hosts")
    assert [d.uuid for d in sim.list_devices()] == [dev.uuid]
    doms = sim.list_domains()
    assert len(doms) == 1 and doms[0].active and doms[0].uuid == vm.domain_uuid

    assert ctl.get_vm(vm.id) == vm
    assert ctl.get_vm("acme/web-1") == vm
    assert ctl.get_vm("web-1") == vm
    assert [v.id for v in ctl.list_vms()] == [vm.id]
    assert [v.id for v in ctl.list_vms("acme")] == [vm.id]
    g = gpu(ctl, "kvm-a100-01", "0000:81:00.0")
    assert (g["devices"], g["layout"], g["free_units"]) == (1, "A100D-10C@0+10", 70)
    h = host_info(ctl, "kvm-a100-01")
    assert (h["used_vcpus"], h["used_memory_mib"]) == (8, 16384)
    check_store_invariants(ctl.engine)

    ctl.release_vm("acme/web-1")
    assert ctl.list_vms() == []
    with pytest.raises(NotFound, match="web-1"):
        ctl.get_vm("acme/web-1")
    assert sim.list_devices() == [] and sim.list_domains() == []
    g = gpu(ctl, "kvm-a100-01", "0000:81:00.0")
    assert (g["devices"], g["layout"], g["free_units"]) == (0, "", 80)
    assert host_info(ctl, "kvm-a100-01")["used_vcpus"] == 0
    actions = [e["action"] for e in ctl.events("acme")]
    assert actions[:2] == ["tenant.create", "vm.create"] and actions[-1] == "vm.delete"
    assert "vm.start" in [e["action"] for e in ctl.events()]
    check_store_invariants(ctl.engine)
    with pytest.raises(NotFound):
        ctl.release_vm("acme/web-1")


def test_name_unique_per_tenant(acme: Controller) -> None:
    req(acme, "a", "A100D-10C")
    before = store_snapshot(acme)
    with pytest.raises(Conflict, match="'a'"):
        req(acme, "a", "A100D-10C")
    assert store_snapshot(acme) == before
    acme.create_tenant("other")
    req(acme, "a", "A100D-10C", tenant="other")  # another tenant may use the name
    with pytest.raises(InvalidInput, match="several tenants"):
        acme.get_vm("a")
    assert acme.get_vm("other/a").tenant == "other"


def test_dry_run_claims_nothing(acme: Controller, state_dir: Path) -> None:
    before = store_snapshot(acme)
    plan = req(acme, "x", "3g.40gb", dry_run=True)
    assert isinstance(plan, Placement)
    assert plan.host == "kvm-h100-01" and plan.pool == "inference"
    assert plan.devices[0].profile == "3g.40gb" and plan.devices[0].start in (0, 4)
    assert store_snapshot(acme) == before
    assert SimulatedHost("kvm-h100-01", state_dir / "hosts").list_devices() == []
    vm = req(acme, "x", "3g.40gb")  # the real request goes where the dry run said
    assert (vm.host, vm.devices[0].gpu, vm.devices[0].start) == \
        (plan.host, plan.devices[0].gpu, plan.devices[0].start)


# -- geometry rules through the service -------------------------------------------------------------------------


def test_equal_size_gpu_locks_to_one_type_and_unlocks(acme: Controller) -> None:
    ctl = acme
    a = req(ctl, "a", "A100D-20C", pool="training")
    gpu_a = a.devices[0].gpu
    b = req(ctl, "b", "A100D-40C", pool="training")
    assert b.devices[0].gpu != gpu_a  # not on the GPU locked to 20C
    c = req(ctl, "c", "A100D-20C", pool="training")
    assert c.devices[0].gpu == gpu_a  # packed next to the first 20C
    pci = gpu_a.split("/")[1]
    assert gpu(ctl, "kvm-a100-01", pci)["layout"] == "A100D-20C@0+20;A100D-20C@20+20"
    # both equal GPUs of the pool are now locked; the passthrough GPU is another mode
    with pytest.raises(NoCapacity) as err:
        req(ctl, "d", "A100D-80C", pool="training")
    assert err.value.reasons[0]["counts"].get("other-type") == 2
    ctl.release_vm("acme/a")
    ctl.release_vm("acme/c")
    assert gpu(ctl, "kvm-a100-01", pci)["layout"] == ""
    d = req(ctl, "d", "A100D-80C", pool="training")
    assert d.devices[0].gpu == gpu_a and d.devices[0].size == 80
    check_store_invariants(ctl.engine)


def test_pinned_gpu_takes_only_its_type(acme: Controller) -> None:
    with pytest.raises(NoCapacity) as err:
        req(acme, "a", "A100D-20C", pool="inference")
    assert err.value.reasons[0]["counts"] == {"other-type": 1}  # the H100s are not A100D-20C candidates
    vms = [req(acme, f"v{i}", "A100D-10C", pool="inference") for i in range(8)]
    assert sorted(v.devices[0].start for v in vms) == [0, 10, 20, 30, 40, 50, 60, 70]
    with pytest.raises(NoCapacity) as err:
        req(acme, "v8", "A100D-10C", pool="inference")
    assert err.value.reasons[0]["counts"].get("max-count", 0) + err.value.reasons[0]["counts"].get("no-space", 0) == 1


def test_mig_placements_at_allowed_starts(acme: Controller) -> None:
    ctl = acme
    vms = [req(ctl, f"m{i}", p, pool="inference")
           for i, p in enumerate(["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"])]
    allowed = {"3g.40gb": {0, 4}, "2g.20gb": {0, 2, 4}, "1g.10gb": set(range(7))}
    for v in vms:
        d = v.devices[0]
        assert d.start in allowed[d.profile] and d.kind == "mig" and d.backing == "mig"
    # 3-2-1-1 on one GPU: the pack policy fills the first GPU before touching the second
    layouts = {v.devices[0].gpu for v in vms[:4]}
    assert len(layouts) == 1
    g = gpu(ctl, "kvm-h100-01", next(iter(layouts)).split("/")[1])
    assert g["free_units"] == 0
    check_store_invariants(ctl.engine)


def test_fixed_mig_layout_only_offers_its_slots(acme: Controller) -> None:
    ctl = acme
    with pytest.raises(NoCapacity) as err:
        req(ctl, "a", "3g.40gb", pool="training")
    assert err.value.reasons[0]["counts"].get("not-in-layout") == 1
    vm = req(ctl, "b", "H100-2-20C", pool="training")
    assert (vm.devices[0].gpu, vm.devices[0].start) == ("kvm-h100-01/0000:4c:00.0", 4)
    vm = req(ctl, "c", "1g.10gb", pool="training")
    assert (vm.devices[0].gpu, vm.devices[0].start) == ("kvm-h100-01/0000:4c:00.0", 6)


def test_passthrough_whole_gpu(acme: Controller) -> None:
    vm = req(acme, "pt", "A100-80GB", pool="training")
    d = vm.devices[0]
    assert (d.gpu, d.kind, d.backing, d.start, d.size) == ("kvm-a100-01/0000:c1:00.0", "passthrough", "pci", 0, 80)
    with pytest.raises(NoCapacity):
        req(acme, "pt2", "A100-80GB", pool="training")


def test_mixed_size_vgpus_share_a_gpu(acme: Controller) -> None:
    ctl = acme
    sizes = ["L40S-24C", "L40S-12C", "L40S-8C", "L40S-24C", "L40S-12C"]
    vms = [req(ctl, f"w{i}", p, pool="workstations") for i, p in enumerate(sizes)]
    mixed = {"L40S-24C": {0, 24}, "L40S-12C": {0, 12, 24, 36}, "L40S-8C": {0, 16, 24, 40}}
    for v in vms:
        assert v.devices[0].start in mixed[v.devices[0].profile]
    # spread policy: the first two go to different GPUs
    assert vms[0].devices[0].gpu != vms[1].devices[0].gpu
    check_store_invariants(ctl.engine)


def test_multi_vgpu_vm_on_one_host_distinct_gpus(acme: Controller) -> None:
    ctl = acme
    vm = req(ctl, "big", [("3g.40gb", 2)], pool="inference", vcpus=16)
    assert len(vm.devices) == 2
    assert {d.gpu.split("/")[0] for d in vm.devices} == {vm.host}
    vm2 = req(ctl, "two", [("A100D-20C", 2)], pool="training")
    assert len({d.gpu for d in vm2.devices}) == 2, "a multi-vGPU VM gets distinct GPUs"
    mixed = req(ctl, "mix", [("L40S-24C", 1), ("L40S-12C", 1)], pool="workstations")
    assert len({d.gpu for d in mixed.devices}) == 2 and mixed.host == "kvm-l40s-01"
    check_store_invariants(ctl.engine)
    with pytest.raises(NoCapacity):
        req(ctl, "three", [("L40S-48C", 3)], pool="workstations")  # the host has only two GPUs
    ctl.release_vm("acme/big")
    check_store_invariants(ctl.engine)


def test_labels_respected(acme: Controller) -> None:
    vm = req(acme, "a", "A100D-20C", labels={"rack": "r1"})
    assert vm.host == "kvm-a100-01"
    vm = req(acme, "b", "1g.10gb", labels={"zone": "a"})
    assert vm.host == "kvm-h100-01"
    before = store_snapshot(acme)
    with pytest.raises(NoCapacity) as err:
        req(acme, "c", "1g.10gb", labels={"zone": "b"})
    assert err.value.reasons == [{"kind": "capacity", "pool": "inference", "gpus": 3, "counts": {"labels": 3}},
                                 {"kind": "capacity", "pool": "training", "gpus": 4, "counts": {"labels": 4}}]
    assert_unchanged_but_refusal(acme, before)


def test_anti_affinity_respected(acme: Controller) -> None:
    a = req(acme, "a", "1g.10gb", anti_affinity="db")
    with pytest.raises(NoCapacity) as err:
        req(acme, "b", "1g.10gb", anti_affinity="db")  # only one host offers MIG 1g.10gb
    assert a.host == "kvm-h100-01"
    assert any(r["counts"] for r in err.value.reasons)
    c = req(acme, "c", "A100D-20C", anti_affinity="db")
    assert c.host != a.host
    b = req(acme, "b", "1g.10gb", anti_affinity="web")  # another group is fine
    assert b.host == a.host


def test_draining_host_gets_nothing(acme: Controller, tmp_path: Path) -> None:
    text = DEMO.read_text().replace("    labels: {rack: r3, zone: b}\n", "    labels: {rack: r3, zone: b}\n"
                                                                       "    state: draining\n")
    acme.apply_inventory(write_inventory(tmp_path, text))
    before = store_snapshot(acme)
    with pytest.raises(NoCapacity) as err:
        req(acme, "w", "L40S-8C", pool="workstations")
    assert err.value.reasons == [{"kind": "capacity", "pool": "workstations", "gpus": 2,
                                  "counts": {"host-draining": 2}}]
    assert_unchanged_but_refusal(acme, before)
    acme.apply_inventory(write_inventory(tmp_path, text.replace("state: draining", "state: active")))
    assert req(acme, "w", "L40S-8C", pool="workstations").host == "kvm-l40s-01"


def test_host_vcpu_and_memory_accounting_with_overcommit(acme: Controller) -> None:
    ctl = acme
    # kvm-l40s-01: 96 vCPUs, overcommit 1.0; 768 GiB memory
    a = req(ctl, "a", "L40S-8C", pool="workstations", vcpus=64, memory_mib=262144)
    b = req(ctl, "b", "L40S-8C", pool="workstations", vcpus=32, memory_mib=262144)
    h = host_info(ctl, "kvm-l40s-01")
    assert (h["used_vcpus"], h["used_memory_mib"]) == (96, 524288)
    with pytest.raises(NoCapacity) as err:
        req(ctl, "c", "L40S-8C", pool="workstations", vcpus=1, memory_mib=1024)
    assert err.value.reasons[0]["counts"] == {"vcpus": 2}
    ctl.release_vm(b.id)
    with pytest.raises(NoCapacity) as err:
        req(ctl, "c", "L40S-8C", pool="workstations", vcpus=1, memory_mib=600000)
    assert err.value.reasons[0]["counts"] == {"memory": 2}
    req(ctl, "c", "L40S-8C", pool="workstations", vcpus=32, memory_mib=500000)
    assert host_info(ctl, "kvm-l40s-01")["used_vcpus"] == 96
    # kvm-a100-01: 128 vCPUs at 2.0 overcommit = 256
    req(ctl, "d", "A100D-10C", pool="inference", vcpus=200)
    req(ctl, "e", "A100D-10C", pool="inference", vcpus=56)
    with pytest.raises(NoCapacity):
        req(ctl, "f", "A100D-10C", pool="inference", vcpus=1)
    assert host_info(ctl, "kvm-a100-01")["used_vcpus"] == 256
    check_store_invariants(ctl.engine)
    ctl.release_vm(a.id)
    check_store_invariants(ctl.engine)


def test_refusal_reasons_structure(acme: Controller) -> None:
    with pytest.raises(NoCapacity) as err:
        req(acme, "x", "A100D-10C", vcpus=500)
    e = err.value
    assert e.code == "no_capacity" and e.exit_code == 3
    pools = {r["pool"]: r for r in e.reasons}
    assert set(pools) == {"inference", "training"}  # workstations does not offer the profile
    for r in e.reasons:
        assert r["kind"] == "capacity" and isinstance(r["gpus"], int) and r["counts"] == {"vcpus": r["gpus"]}
    assert "x" in e.message and "A100D-10C" in e.message and "vcpus" in e.message.lower()
    # fill the training A100s with a type, then ask for another on a GPU of another mode
    req(acme, "t1", "A100D-40C", pool="training")  # packs onto the first A100
    req(acme, "t2", "A100D-80C", pool="training")  # the other one
    with pytest.raises(NoCapacity) as err:
        req(acme, "t3", "A100D-20C", pool="training")
    assert err.value.reasons == [{"kind": "capacity", "pool": "training", "gpus": 3,
                                  "counts": {"other-type": 2, "other-mode": 1}}]
    req(acme, "t3", "A100D-40C", pool="training")
    with pytest.raises(NoCapacity) as err:
        req(acme, "t4", "A100D-40C", pool="training")
    counts = err.value.reasons[0]["counts"]
    assert counts.pop("other-type") == 1 and counts.pop("other-mode") == 1
    assert counts in ({"no-space": 1}, {"max-count": 1})
    assert "pool training: 3 GPUs" in err.value.message


# -- bad requests ------------------------------------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any], type[Exception], str, Any]] = [
    ("unknown tenant", {"tenant": "nobody"}, NotFound, "tenant", "nobody"),
    ("unknown pool", {"pool": "nowhere"}, NotFound, "pool", "nowhere"),
    ("unknown profile", {"vgpus": [("A100D-3C", 1)]}, InvalidInput, "profile", "A100D-3C"),
    ("profile not in pool", {"vgpus": [("3g.40gb", 1)], "pool": "workstations"}, InvalidInput, "profile",
     "3g.40gb"),
    ("zero vcpus", {"vcpus": 0}, InvalidInput, "vcpus", 0),
    ("negative vcpus", {"vcpus": -2}, InvalidInput, "vcpus", -2),
    ("zero memory", {"memory_mib": 0}, InvalidInput, "memory_mib", 0),
    ("zero count", {"vgpus": [("A100D-10C", 0)]}, InvalidInput, "count", 0),
    ("negative count", {"vgpus": [("A100D-10C", -1)]}, InvalidInput, "count", -1),
    ("too many vgpus", {"vgpus": [("1g.10gb", 17)]}, InvalidInput, "count", None),
    ("name with space", {"name": "a b"}, InvalidInput, "name", "a b"),
    ("name with markup", {"name": "<x>"}, InvalidInput, "name", "<x>"),
    ("upper-case name", {"name": "Web"}, InvalidInput, "name", "Web"),
    ("unsafe tenant", {"tenant": "a;b"}, InvalidInput, "tenant", "a;b"),
    ("unsafe anti-affinity", {"anti_affinity": "x y"}, InvalidInput, "anti_affinity", "x y"),
    ("vcpus not int", {"vcpus": "4"}, InvalidInput, "vcpus", "4"),
]


@pytest.mark.parametrize("changes,exc,field,value", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_changes_nothing(acme: Controller, changes: dict[str, Any], exc: type[Exception], field: str,
                                     value: Any) -> None:
    req(acme, "keep", "A100D-10C")
    args: dict[str, Any] = {"tenant": "acme", "name": "vm1", "vgpus": [("A100D-10C", 1)], "vcpus": 2,
                            "memory_mib": 2048, **changes}
    before = store_snapshot(acme)
    usage = acme.tenant_usage("acme")
    with pytest.raises(exc) as err:
        acme.request_vm(args.pop("tenant"), args.pop("name"), args.pop("vgpus"), **args)
    e: Any = err.value
    assert field in e.message or field.replace("_", "-") in e.message, e.message
    assert any(r.get("field") == field for r in e.reasons), e.reasons
    if value is not None:
        assert repr(value) in e.message or str(value) in e.message, e.message
        assert any(r.get("value") == value for r in e.reasons), e.reasons
    assert store_snapshot(acme) == before
    assert acme.tenant_usage("acme") == usage
    with pytest.raises(exc):  # a dry run refuses the same way
        acme.request_vm(*(changes.get(k, d) for k, d in (("tenant", "acme"), ("name", "vm1"),
                                                         ("vgpus", [("A100D-10C", 1)]))),
                        vcpus=changes.get("vcpus", 2), memory_mib=changes.get("memory_mib", 2048),
                        pool=changes.get("pool"), anti_affinity=changes.get("anti_affinity"), dry_run=True)


def test_vgpus_as_string(acme: Controller) -> None:
    vm = acme.request_vm("acme", "s", "A100D-10C", vcpus=1, memory_mib=1024)
    assert [d.profile for d in vm.devices] == ["A100D-10C"]


# -- idempotency ----------------------------------------------------------------------------------------------


def test_idempotency_key_returns_same_vm(acme: Controller) -> None:
    a = req(acme, "a", "A100D-10C", idempotency_key="req-123")
    b = req(acme, "a", "A100D-10C", idempotency_key="req-123")
    assert a.id == b.id
    with pytest.raises(Conflict, match="req-123"):  # the key names one request: another one is a conflict
        req(acme, "other-name", "A100D-10C", idempotency_key="req-123")
    assert len(acme.list_vms()) == 1
    assert acme.tenant_usage("acme")[0] == {"scope": "*", "resource": "vms", "used": 1, "limit": None,
                                              "guarantee": None, "borrowed": None}
    acme.create_tenant("beta")
    d = req(acme, "a", "A100D-10C", tenant="beta", idempotency_key="req-123")
    assert d.id != a.id  # keys are per tenant
    check_store_invariants(acme.engine)


def test_idempotency_key_validated(acme: Controller) -> None:
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match="idempotency_key"):
        req(acme, "a", "A100D-10C", idempotency_key="x" * 200)
    with pytest.raises(InvalidInput, match="idempotency_key"):
        req(acme, "a", "A100D-10C", idempotency_key="")
    assert store_snapshot(acme) == before
