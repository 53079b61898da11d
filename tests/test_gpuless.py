"""VMs without vGPUs: placed on a pool's hosts by their vCPU and memory headroom in the pool policy's host order,
charged to quotas (no vGPUs, no framebuffer), audited, explained per host when refused, released cleanly; they
queue but never preempt (preemption frees GPU space by geometry). Through the Controller, the CLI and the API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apifixtures import api_server
from conftest import Cli, assert_unchanged_but_refusal, check_store_invariants, store_snapshot, write_inventory
from lxml import etree

from vgpu_ctl import Controller
from vgpu_ctl.errors import InvalidInput, NoCapacity, NotFound, QuotaExceeded

# h1 is the smaller host, h2 the larger (two GPUs in pack: a refusal still counts it once); h3 holds no GPU of
# any pool, so no pool's VM goes there.
INVENTORY = """\
pools:
  - {name: pack, policy: pack}
  - {name: spread, policy: spread}
  - {name: first, policy: first-fit}
  - {name: solo, policy: pack}
hosts:
  - name: h1
    uri: "simulated:///h1"
    driver: simulated
    vcpus: 8
    memory_mib: 8192
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: pack}
      - {pci: "0000:42:00.0", model: A100-80GB, mode: vgpu-equal, pool: spread}
      - {pci: "0000:43:00.0", model: A100-80GB, mode: vgpu-equal, pool: first}
      - {pci: "0000:44:00.0", model: A100-80GB, mode: vgpu-equal, pool: solo}
  - name: h2
    uri: "simulated:///h2"
    driver: simulated
    vcpus: 16
    memory_mib: 16384
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: pack}
      - {pci: "0000:42:00.0", model: A100-80GB, mode: vgpu-equal, pool: spread}
      - {pci: "0000:43:00.0", model: A100-80GB, mode: vgpu-equal, pool: first}
      - {pci: "0000:44:00.0", model: A100-80GB, mode: vgpu-equal, pool: pack}
  - name: h3
    uri: "simulated:///h3"
    driver: simulated
    vcpus: 64
    memory_mib: 65536
"""


@pytest.fixture
def fleet(store_url: str, state_dir: Path, tmp_path: Path) -> Iterator[Controller]:
    c = Controller(store_url)
    c.apply_inventory(write_inventory(tmp_path, INVENTORY))
    c.create_tenant("acme")
    try:
        yield c
    finally:
        c.close()


def _bare(c: Controller, name: str, pool: str | None = "pack", vcpus: int = 2, **kw: Any) -> Any:
    return c.request_vm("acme", name, [], vcpus=vcpus, memory_mib=512, pool=pool, **kw)


def _usage(c: Controller) -> dict[str, int]:
    return {u["resource"]: u["used"] for u in c.tenant_usage("acme")}


def _host_use(c: Controller) -> dict[str, tuple[int, int]]:
    from sqlalchemy import select

    from vgpu_ctl.store.tables import HOST
    with c.engine.connect() as conn:
        return {r.name: (r.used_vcpus, r.used_memory_mib) for r in conn.execute(select(HOST))}


def test_a_vm_without_vgpus_runs_stops_starts_and_is_released(fleet: Controller) -> None:
    vm = _bare(fleet, "web")
    assert (vm.state, vm.host, vm.pool, vm.devices, vm.framebuffer_mib) == ("running", "h1", "pack", (), 0)
    assert {k: _usage(fleet)[k] for k in ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib")} == \
        {"vms": 1, "vgpus": 0, "framebuffer_mib": 0, "vcpus": 2, "memory_mib": 512}
    assert _host_use(fleet)["h1"] == (2, 512)
    doc = etree.fromstring(fleet.vm_xml(vm.id).encode())
    assert doc.findall("devices/hostdev") == [] and doc.findtext("vcpu") == "2"
    (ev,) = [e for e in fleet.events("acme") if e["action"] == "vm.create"]
    assert ev["result"] == "ok" and ev["params"]["devices"] == [] and ev["params"]["host"] == "h1"
    check_store_invariants(fleet.engine)
    assert fleet.stop_vm(vm.id).state == "stopped"
    assert fleet.start_vm(vm.id).state == "running"
    fleet.release_vm(vm.id)
    assert fleet.list_vms() == [] and set(_usage(fleet).values()) == {0}
    assert _host_use(fleet) == {"h1": (0, 0), "h2": (0, 0), "h3": (0, 0)}
    check_store_invariants(fleet.engine)


def test_hosts_are_chosen_in_the_pool_policys_order(fleet: Controller) -> None:
    assert _bare(fleet, "p1", "pack", vcpus=6).host == "h1"  # pack: the fullest host that fits
    assert _bare(fleet, "p2", "pack", vcpus=4).host == "h2"  # h1 has 2 vCPUs left
    assert _bare(fleet, "p3", "pack", vcpus=2).host == "h1"  # fullest again: h1 fits it exactly
    fleet.release_vm("acme/p1")
    fleet.release_vm("acme/p3")
    assert _bare(fleet, "s1", "spread").host == "h2"  # spread: the emptiest (h2: 12 free, h1: 8)
    assert _bare(fleet, "f1", "first").host == "h1"  # first-fit: host order
    check_store_invariants(fleet.engine)


def test_without_a_pool_the_pools_are_tried_in_order_and_a_host_outside_every_pool_takes_none(
        fleet: Controller) -> None:
    vm = _bare(fleet, "any", None, vcpus=8)
    assert (vm.pool, vm.host) == ("first", "h1")  # pools by name; first-fit: host order
    vm2 = _bare(fleet, "any2", None, vcpus=16)
    assert (vm2.pool, vm2.host) == ("first", "h2")
    with pytest.raises(NoCapacity) as err:  # h3 has 64 free vCPUs but holds no pool's GPU
        _bare(fleet, "any3", None, vcpus=1)
    assert "pool first: 2 hosts, 2 hosts short of vCPUs" in err.value.message
    assert "h3" not in err.value.message


def test_a_refusal_says_why_per_host_and_changes_nothing(fleet: Controller) -> None:
    fleet.set_host_state("h2", "draining")
    before = store_snapshot(fleet)
    with pytest.raises(NoCapacity) as err:
        _bare(fleet, "big", "pack", vcpus=12)
    assert err.value.message == ("no host can take VM 'big' (no vGPUs, 12 vCPUs, 512 MiB): pool pack: 2 hosts, "
                                 "1 host cordoned (draining), 1 host short of vCPUs")
    (r,) = err.value.reasons
    assert r == {"kind": "capacity", "pool": "pack", "hosts": 2, "counts": {"host-draining": 1, "vcpus": 1}}
    assert_unchanged_but_refusal(fleet, before)


def test_quotas_charge_vcpus_and_memory_and_no_vgpus(fleet: Controller) -> None:
    fleet.set_quota("acme", {"vgpus": 0, "framebuffer_mib": 0, "vcpus": 3})
    _bare(fleet, "one")  # no vGPUs: a vgpus limit of 0 does not stand in its way
    before = store_snapshot(fleet)
    with pytest.raises(QuotaExceeded, match="vcpus: 2 used \\+ 2 requested > limit 3"):
        _bare(fleet, "two")
    assert_unchanged_but_refusal(fleet, before)


def test_dry_run_and_ranked_candidates(fleet: Controller) -> None:
    placed = _bare(fleet, "dry", "spread", dry_run=True)
    assert (placed.host, placed.pool, placed.devices) == ("h2", "spread", ())
    assert fleet.list_vms() == []
    ranked = {pool: [(r["host"], r["rank"]) for r in fleet.placement_candidates(
        "acme", [], vcpus=2, memory_mib=512, pool=pool)] for pool in ("pack", "spread", "first")}
    assert ranked == {"pack": [("h1", 1), ("h2", 2)], "spread": [("h2", 1), ("h1", 2)],
                      "first": [("h1", 1), ("h2", 2)]}
    rows = fleet.placement_candidates("acme", [], vcpus=10, memory_mib=512, pool="spread")
    assert [(r["host"], r["rank"], r["devices"]) for r in rows] == [("h2", 1, []), ("h1", None, [])]
    assert rows[1]["reasons"] == {"vcpus": 1}


def test_an_idempotency_key_gives_the_same_vm(fleet: Controller) -> None:
    a = _bare(fleet, "keyed", idempotency_key="k1")
    b = _bare(fleet, "keyed", idempotency_key="k1")
    assert a.id == b.id and len(fleet.list_vms()) == 1


def test_it_queues_and_is_admitted_but_never_preempts(fleet: Controller) -> None:
    s = fleet.scheduling
    s.create_class("batch", 10, preemptible=True)
    s.create_class("prod", 1000)
    low = fleet.request_vm("acme", "low", [("A100D-10C", 1)], vcpus=8, memory_mib=512, pool="solo",
                           priority="batch")
    with pytest.raises(NoCapacity) as err:  # prod preempts by its class, but a VM without vGPUs never does
        _bare(fleet, "high", "solo", priority="prod")
    assert "1 host short of vCPUs" in err.value.message
    assert fleet.get_vm(low.id).state == "running"
    assert not [e for e in fleet.events() if e["action"].startswith("vm.preempt")]
    op = _bare(fleet, "waits", "solo", priority="prod", queue=True)
    assert op.state == "pending" and [q["name"] for q in s.queue()] == ["waits"]
    fleet.release_vm(low.id)  # capacity freed: the queue is admitted
    vm = fleet.get_vm("acme/waits")
    assert (vm.state, vm.host, vm.devices) == ("running", "h1", ())
    check_store_invariants(fleet.engine)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_bad_input_still_names_the_field(fleet: Controller) -> None:
    before = store_snapshot(fleet)
    with pytest.raises(InvalidInput, match=r"vcpus must be a whole number from 1 to \d+, got 0"):
        _bare(fleet, "zero", vcpus=0)
    with pytest.raises(NotFound, match=r"pool 'nope' not found \(known: first, pack, solo, spread\)"):
        _bare(fleet, "nopool", "nope")
    assert store_snapshot(fleet) == before


def test_cli_creates_and_deletes_a_vm_without_vgpus(state_dir: Path, sqlite_url: str, tmp_path: Path) -> None:
    cli = Cli(sqlite_url)
    cli.json("inventory", "apply", str(write_inventory(tmp_path, INVENTORY)))
    cli.json("tenant", "create", "acme")
    vm = cli.json("vm", "create", "--tenant", "acme", "--name", "web", "--vcpus", "2", "--memory", "512MiB",
                  "--pool", "pack")
    assert (vm["state"], vm["host"], vm["devices"]) == ("running", "h1", [])
    text = cli("vm", "show", "acme/web")
    assert text.exit_code == 0 and "vCPUs=2 memory=512MiB" in text.output
    bad = cli("vm", "create", "--tenant", "acme", "--name", "web2", "--vcpus", "2", "--memory", "512MiB",
              "--count", "2")
    assert bad.exit_code == 2 and "--count 2 needs a --profile" in bad.output
    assert [v["name"] for v in cli.json("vm", "list")] == ["web"]
    cli.json("vm", "delete", "acme/web")
    assert cli.json("vm", "list") == []


def test_api_and_client_create_a_vm_without_vgpus(tmp_path: Path) -> None:
    from apifixtures import problem_of

    from vgpu_ctl import Client
    with api_server(tmp_path) as srv:  # the demo fleet
        acme = srv.client("acme")
        r = acme.post("/v1/vms", params={"wait": "30s"}, json={"name": "web", "vgpus": [], "vcpus": 2,
                                                                "memory_mib": 512})
        assert r.status_code == 201, r.text
        assert r.json()["devices"] == [] and r.json()["framebuffer_mib"] == 0 and r.json()["state"] == "running"
        r = acme.post("/v1/vms", params={"wait": "30s"}, json={"name": "web2", "vcpus": 2, "memory_mib": 512})
        assert r.status_code == 201, r.text  # vgpus left out: none
        usage = {q["resource"]: q["used"] for q in acme.get("/v1/tenants/acme/quota").json()}
        assert (usage["vms"], usage["vgpus"], usage["vcpus"], usage["framebuffer_mib"]) == (2, 0, 4, 0)
        p = problem_of(acme.post("/v1/vms", params={"wait": "30s"}, json={
            "name": "huge", "vgpus": [], "vcpus": 4096, "memory_mib": 512}), 409, "no_capacity")
        assert {r["pool"] for r in p["reasons"]} == {"inference", "training", "workstations"}
        assert all(set(r["counts"]) == {"vcpus"} and "hosts" in r for r in p["reasons"]), p["reasons"]
        with Client(srv.url, srv.tokens["acme"]) as client:
            vm = client.request_vm("acme", "web3", [], vcpus=1, memory_mib=256)
            assert vm.devices == () and vm.state == "running"
            client.release_vm(vm.id)
