"""Inventory files: applying, idempotence, dry runs, and every refusal naming file, line, field and value
while leaving the store exactly as it was."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, store_snapshot, write_inventory
from typer.testing import CliRunner

from vgpu_ctl import Conflict, Controller, InvalidInput, InventoryError
from vgpu_ctl.cli.main import app

SMALL = """\
pools:
  - name: p1
hosts:
  - name: h1
    uri: "simulated:///h1"
    driver: simulated
    vcpus: 8
    memory_mib: 8192
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: mig, pool: p1}
"""

# (case id, replacement of SMALL's text, line the error must name, field, value the message must name)
REFUSALS: list[tuple[str, str, int, str, str]] = [
    ("unknown-model", SMALL.replace("A100-80GB", "A999-1GB"), 10, "hosts[0].gpus[0].model", "A999-1GB"),
    ("duplicate-host", SMALL + '  - name: h1\n    uri: "simulated:///h1b"\n    vcpus: 8\n    memory_mib: 8\n',
     11, "hosts[1].name", "h1"),
    ("duplicate-pci", SMALL + '      - {pci: "0000:41:00.0", model: A100-80GB, mode: mig, pool: p1}\n',
     11, "hosts[0].gpus[1].pci", "0000:41:00.0"),
    ("mig-layout-misfit", SMALL.replace("pool: p1}", 'pool: p1, mig_layout: ["3g.40gb@0", "3g.40gb@4", '
                                                      '"1g.10gb@0"]}'),
     10, "hosts[0].gpus[0].mig_layout", "1g.10gb"),
    ("pinned-type-unknown",
     SMALL.replace("mode: mig, pool: p1}", "mode: vgpu-equal, pool: p1, vgpu_type: L40S-8C}"),
     10, "hosts[0].gpus[0].vgpu_type", "L40S-8C"),
    ("pinned-type-not-equal-mode", SMALL.replace("pool: p1}", "pool: p1, vgpu_type: A100D-10C}"),
     10, "hosts[0].gpus[0].vgpu_type", "vgpu-equal"),
    ("bad-uri", SMALL.replace('"simulated:///h1"', '"http://h1; rm -rf /"'), 5, "hosts[0].uri", "http://h1"),
    ("unknown-key", SMALL.replace("    vcpus: 8\n", "    vcpus: 8\n    cores: 8\n"), 8, "hosts[0].cores",
     "cores"),
    ("wrong-type", SMALL.replace("vcpus: 8", 'vcpus: "many"'), 7, "hosts[0].vcpus", "many"),
    ("negative-memory", SMALL.replace("memory_mib: 8192", "memory_mib: -1"), 8, "hosts[0].memory_mib", "-1"),
    ("negative-vcpus", SMALL.replace("vcpus: 8", "vcpus: -4"), 7, "hosts[0].vcpus", "-4"),
    ("zero-overcommit", SMALL.replace("vcpus: 8", "vcpus: 8\n    cpu_overcommit: 0"), 8,
     "hosts[0].cpu_overcommit", "0"),
    ("mixed-on-t4", SMALL.replace("model: A100-80GB, mode: mig", "model: T4, mode: vgpu-mixed"), 10,
     "hosts[0].gpus[0].mode", "vgpu-mixed"),
    ("mig-on-l40s", SMALL.replace("model: A100-80GB", "model: L40S"), 10, "hosts[0].gpus[0].mode", "mig"),
    ("unknown-pool", SMALL.replace("pool: p1}", "pool: nope}"), 10, "hosts[0].gpus[0].pool", "nope"),
    ("unsafe-host-name", SMALL.replace("name: h1", "name: <h1>"), 4, "hosts[0].name", "<h1>"),
    ("bad-pci", SMALL.replace("0000:41:00.0", "41:00"), 10, "hosts[0].gpus[0].pci", "41:00"),
    ("unknown-state", SMALL.replace("vcpus: 8", "vcpus: 8\n    state: sleeping"), 8, "hosts[0].state",
     "sleeping"),
    ("demand-unknown-profile", SMALL.replace("  - name: p1\n", "  - name: p1\n    demand:\n"
                                             "      - {profile: 3g.40gb, weight: 2}\n"
                                             "      - {profile: 9g.90gb, weight: 1}\n"),
     5, "pools[0].demand[1].profile", "9g.90gb"),
    ("demand-zero-weight", SMALL.replace("  - name: p1\n", "  - name: p1\n    demand:\n"
                                         "      - {profile: 3g.40gb, weight: 0}\n"),
     4, "pools[0].demand[0].weight", "0"),
    ("demand-zero-gpus", SMALL.replace("  - name: p1\n", "  - name: p1\n    demand:\n"
                                       "      - {profile: 3g.40gb, gpus: 0, weight: 1}\n"),
     4, "pools[0].demand[0].gpus", "0"),
    ("demand-unknown-key", SMALL.replace("  - name: p1\n", "  - name: p1\n    demand:\n"
                                         "      - {profile: 3g.40gb, cpus: 4, weight: 1}\n"),
     4, "pools[0].demand[0].cpus", "cpus"),
    ("demand-short-form-bad-weight", SMALL.replace("  - name: p1\n", "  - name: p1\n    demand: {3g.40gb: -1}\n"),
     3, "pools[0].demand[0].weight", "-1"),
    ("unknown-policy", SMALL.replace("  - name: p1\n", "  - name: p1\n    policy: tetris\n"),
     3, "pools[0].policy", "tetris"),
]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def sqlite_ctl(sqlite_url: str, state_dir: Path) -> Iterator[Controller]:
    """Parsing refusals never reach the store, so they run on SQLite only (the store_url tests below cover
    refusals that do reach it, on both stores)."""
    c = Controller(sqlite_url)
    c.apply_inventory(DEMO)
    yield c
    c.close()


def cli(runner: CliRunner, url: str, *args: str) -> Any:
    result = runner.invoke(app, ["--db", url, *args])
    return result


def test_demo_applies_and_second_apply_changes_nothing(ctl: Controller) -> None:
    inv = ctl.inventory()
    assert [p["name"] for p in inv["pools"]] == ["inference", "training", "workstations"]
    assert [h["name"] for h in inv["hosts"]] == ["kvm-a100-01", "kvm-h100-01", "kvm-l40s-01"]
    assert all(h["simulated"] for h in inv["hosts"])
    assert sum(len(h["gpus"]) for h in inv["hosts"]) == 9
    before = store_snapshot(ctl)
    assert ctl.apply_inventory(DEMO) == []
    assert store_snapshot(ctl) == before
    gpus = {g["pci"]: g for h in inv["hosts"] for g in h["gpus"]}
    assert gpus["0000:81:00.0"]["vgpu_type"] == "A100D-10C"
    assert gpus["0000:c1:00.0"]["mode"] == "passthrough"
    assert gpus["0000:4c:00.0"]["free_units"] == 8 and gpus["0000:4c:00.0"]["axis_units"] == 8


def test_dry_run_changes_nothing(store_url: str, tmp_path: Path) -> None:
    c = Controller(store_url)
    try:
        before = store_snapshot(c)
        changes = c.apply_inventory(DEMO, dry_run=True)
        kinds = {(ch["action"], ch["kind"]) for ch in changes}
        assert kinds == {("add", "pool"), ("add", "host"), ("add", "gpu")}
        assert len([ch for ch in changes if ch["kind"] == "gpu"]) == 9
        assert store_snapshot(c) == before
        assert c.apply_inventory(DEMO) == changes  # the real apply makes what the dry run showed
        after = store_snapshot(c)
        edited = write_inventory(tmp_path, DEMO.read_text().replace("vcpus: 96", "vcpus: 64"))
        dry = c.apply_inventory(edited, dry_run=True)
        assert dry == [{"action": "update", "kind": "host", "name": "kvm-l40s-01",
                        "fields": {"vcpus": {"from": 96, "to": 64}}}]
        assert store_snapshot(c) == after
    finally:
        c.close()


def test_apply_records_one_event(ctl: Controller) -> None:
    events = [e for e in ctl.events() if e["action"] == "inventory.apply"]
    assert len(events) == 1 and events[0]["params"]["changes"] > 0


def test_cli_apply_twice(state_dir: Path, sqlite_url: str, runner: CliRunner) -> None:
    first = cli(runner, sqlite_url, "inventory", "apply", str(DEMO), "--json")
    assert first.exit_code == 0, first.output
    assert len(json.loads(first.stdout)["changes"]) == 3 + 3 + 9
    second = cli(runner, sqlite_url, "inventory", "apply", str(DEMO), "--json")
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["changes"] == []
    text = cli(runner, sqlite_url, "inventory", "apply", str(DEMO))
    assert text.exit_code == 0 and "no changes" in text.stdout


def test_cli_dry_run(state_dir: Path, sqlite_url: str, runner: CliRunner) -> None:
    out = cli(runner, sqlite_url, "inventory", "apply", str(DEMO), "--dry-run", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["dry_run"] is True and data["changes"]
    shown = cli(runner, sqlite_url, "inventory", "show", "--json")
    assert json.loads(shown.stdout)["hosts"] == []


@pytest.mark.parametrize("text,line,field,value", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_inventory(sqlite_ctl: Controller, tmp_path: Path, text: str, line: int, field: str,
                           value: str) -> None:
    ctl = sqlite_ctl
    path = write_inventory(tmp_path, text)
    before = store_snapshot(ctl)
    with pytest.raises(InventoryError) as err:
        ctl.apply_inventory(path)
    msg = err.value.message
    assert msg.startswith(f"{path}:{line}: "), msg
    assert f"field {field}:" in msg, msg
    assert value in msg, msg
    assert err.value.reasons[0]["line"] == line and err.value.reasons[0]["field"] == field
    with pytest.raises(InventoryError):
        ctl.apply_inventory(path, dry_run=True)
    assert store_snapshot(ctl) == before


@pytest.mark.parametrize("text,line,field,value", [REFUSALS[1][1:], REFUSALS[8][1:]],
                         ids=[REFUSALS[1][0], REFUSALS[8][0]])
def test_cli_refused_inventory(state_dir: Path, sqlite_url: str, runner: CliRunner, tmp_path: Path, text: str,
                               line: int, field: str, value: str) -> None:
    path = write_inventory(tmp_path, text)
    out = cli(runner, sqlite_url, "inventory", "apply", str(path), "--json")
    assert out.exit_code == 2, out.output
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "inventory"
    assert f"{path}:{line}" in error["message"] and field in error["message"] and value in error["message"]
    shown = cli(runner, sqlite_url, "inventory", "show", "--json")
    assert json.loads(shown.stdout)["hosts"] == []


def test_not_yaml_and_not_a_mapping(ctl: Controller, tmp_path: Path) -> None:
    before = store_snapshot(ctl)
    with pytest.raises(InventoryError, match=r":\d+: not valid YAML"):
        ctl.apply_inventory(write_inventory(tmp_path, "hosts: [\n  - {name: x\n"))
    with pytest.raises(InventoryError, match="expected a mapping"):
        ctl.apply_inventory(write_inventory(tmp_path, "- a\n- b\n", "list.yaml"))
    with pytest.raises(InventoryError, match="cannot read"):
        ctl.apply_inventory(tmp_path / "missing.yaml")
    assert store_snapshot(ctl) == before


# -- changes that touch GPUs with devices ----------------------------------------------------------------


def _demo_edit(tmp_path: Path, old: str, new: str) -> Path:
    text = DEMO.read_text()
    assert old in text
    return write_inventory(tmp_path, text.replace(old, new, 1), "edited.yaml")


def _with_vm_on_inference_a100(ctl: Controller) -> str:
    ctl.create_tenant("acme")
    vm = ctl.request_vm("acme", "vm1", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference")
    assert vm.devices[0].gpu == "kvm-a100-01/0000:81:00.0"
    return vm.name


def test_removing_gpu_with_devices_refused(ctl: Controller, tmp_path: Path) -> None:
    name = _with_vm_on_inference_a100(ctl)
    path = _demo_edit(tmp_path, '      - {pci: "0000:81:00.0", model: A100-80GB, mode: vgpu-equal, '
                                'pool: inference, vgpu_type: A100D-10C}\n', "")
    before = store_snapshot(ctl)
    with pytest.raises(Conflict) as err:
        ctl.apply_inventory(path, prune=True)
    assert "0000:81:00.0" in err.value.message and name in err.value.message
    assert err.value.reasons[0]["vms"] == [name]
    assert store_snapshot(ctl) == before


def test_removing_host_with_devices_refused(ctl: Controller, tmp_path: Path) -> None:
    name = _with_vm_on_inference_a100(ctl)
    text = DEMO.read_text()
    start = text.index("  - name: kvm-a100-01")
    end = text.index("  - name: kvm-h100-01")
    path = write_inventory(tmp_path, text[:start] + text[end:])
    before = store_snapshot(ctl)
    with pytest.raises(Conflict) as err:
        ctl.apply_inventory(path, prune=True)
    assert "kvm-a100-01" in err.value.message and name in err.value.message
    assert store_snapshot(ctl) == before


def test_recarving_gpu_with_devices_refused(ctl: Controller, tmp_path: Path) -> None:
    name = _with_vm_on_inference_a100(ctl)
    path = _demo_edit(tmp_path, "mode: vgpu-equal, pool: inference, vgpu_type: A100D-10C}",
                      "mode: mig, pool: inference}")
    before = store_snapshot(ctl)
    with pytest.raises(Conflict, match=re.escape(name)):
        ctl.apply_inventory(path)
    assert store_snapshot(ctl) == before
    path = _demo_edit(tmp_path, "vgpu_type: A100D-10C}", "vgpu_type: A100D-20C}")
    with pytest.raises(Conflict, match="pinned_type"):
        ctl.apply_inventory(path)
    assert store_snapshot(ctl) == before


def test_changing_pool_of_gpu_with_devices_is_fine(ctl: Controller, tmp_path: Path) -> None:
    _with_vm_on_inference_a100(ctl)
    path = _demo_edit(tmp_path, "pool: inference, vgpu_type: A100D-10C}",
                      "pool: training, vgpu_type: A100D-10C}")
    changes = ctl.apply_inventory(path)
    assert [(c["action"], c["kind"], c["name"]) for c in changes] == [
        ("update", "gpu", "kvm-a100-01/0000:81:00.0")]
    assert changes[0]["fields"] == {"pool": {"from": "inference", "to": "training"}}
    gpu = next(g for h in ctl.inventory()["hosts"] for g in h["gpus"] if g["pci"] == "0000:81:00.0")
    assert gpu["pool"] == "training" and gpu["devices"] == 1 and gpu["layout"] == "A100D-10C@0+10"
    assert ctl.get_vm("acme/vm1").state == "running"
    ctl.release_vm("acme/vm1")
    gpu = next(g for h in ctl.inventory()["hosts"] for g in h["gpus"] if g["pci"] == "0000:81:00.0")
    assert gpu["devices"] == 0 and gpu["layout"] == "" and gpu["free_units"] == 80


def test_removing_empty_gpu_and_host(ctl: Controller, tmp_path: Path) -> None:
    text = DEMO.read_text()
    start = text.index("  - name: kvm-l40s-01")
    path = write_inventory(tmp_path, text[:start])
    changes = ctl.apply_inventory(path, prune=True)
    assert ("remove", "host", "kvm-l40s-01") in [(c["action"], c["kind"], c["name"]) for c in changes]
    assert [h["name"] for h in ctl.inventory()["hosts"]] == ["kvm-a100-01", "kvm-h100-01"]


def test_an_empty_gpu_left_out_is_kept_or_removed_with_prune(ctl: Controller, tmp_path: Path) -> None:
    path = _demo_edit(tmp_path, '      - {pci: "0000:61:00.0", model: A100-80GB, mode: vgpu-equal, pool: training}\n',
                      "")
    kept = [(c["action"], c["kind"], c["name"]) for c in ctl.apply_inventory(path)]
    assert kept == [("keep", "gpu", "kvm-a100-01/0000:61:00.0")]
    removed = [(c["action"], c["kind"], c["name"]) for c in ctl.apply_inventory(path, prune=True)]
    assert removed == [("remove", "gpu", "kvm-a100-01/0000:61:00.0")]
    gpus = [g["pci"] for h in ctl.inventory()["hosts"] if h["name"] == "kvm-a100-01" for g in h["gpus"]]
    assert "0000:61:00.0" not in gpus and len(gpus) == 3


def test_draining_state_applies(ctl: Controller, tmp_path: Path) -> None:
    path = _demo_edit(tmp_path, "    labels: {rack: r3, zone: b}\n",
                      "    labels: {rack: r3, zone: b}\n    state: draining\n")
    changes = ctl.apply_inventory(path)
    assert changes == [{"action": "update", "kind": "host", "name": "kvm-l40s-01",
                        "fields": {"state": {"from": "active", "to": "draining"}}}]
    assert ctl.apply_inventory(path) == []


# -- a pool's demand: typical requests for host-aware packing --------------------------------------------------

DEMAND = """
pools:
  - name: p1
    demand:{demand}
hosts:
  - name: h1
    uri: "simulated:///h1"
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {{pci: "0000:41:00.0", model: A100-80GB, mode: passthrough, pool: p1}}
      - {{pci: "0000:61:00.0", model: A100-80GB, mode: passthrough, pool: p1}}
  - name: h2
    uri: "simulated:///h2"
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {{pci: "0000:41:00.0", model: A100-80GB, mode: passthrough, pool: p1}}
"""
PAIRS = "\n      - {profile: A100-80GB, gpus: 2, vcpus: 16, memory_mib: 65536, weight: 1}"
SINGLES = " {A100-80GB: 1}"


def test_demand_of_typical_requests_is_stored(ctl: Controller, tmp_path: Path) -> None:
    path = write_inventory(tmp_path, DEMAND.format(demand=PAIRS))
    ctl.apply_inventory(path)
    (pool,) = [p for p in ctl.pools() if p["name"] == "p1"]
    assert pool["demand"] == [{"profile": "A100-80GB", "gpus": 2, "vcpus": 16, "memory_mib": 65536, "weight": 1.0}]
    made = [c for c in ctl.apply_inventory(path) if c["action"] != "keep"]  # the demo's hosts are kept
    assert made == []  # the same file again: nothing to change
    short = write_inventory(tmp_path, DEMAND.format(demand=SINGLES), "short.yaml")
    changes = [c for c in ctl.apply_inventory(short) if c["action"] != "keep"]
    assert [c["name"] for c in changes] == ["p1"]
    (pool,) = [p for p in ctl.pools() if p["name"] == "p1"]
    assert pool["demand"] == [{"profile": "A100-80GB", "gpus": 1, "vcpus": 0, "memory_mib": 0, "weight": 1.0}]


@pytest.mark.parametrize("demand,host", [(SINGLES, "h1"), (PAIRS, "h2")], ids=["single-gpu-demand", "pairs"])
def test_pack_keeps_a_pair_of_gpus_for_a_demand_of_pairs(store_url: str, state_dir: Path, tmp_path: Path,
                                                        demand: str, host: str) -> None:
    """One whole GPU: with single-GPU requests expected, the first host in order; with pairs expected, the host
    whose lone GPU no pair could use, so that h1 keeps both of its GPUs for the next pair."""
    c = Controller(store_url)
    try:
        c.apply_inventory(write_inventory(tmp_path, DEMAND.format(demand=demand)))
        c.create_tenant("acme")
        vm = c.request_vm("acme", "one", [("A100-80GB", 1)], vcpus=8, memory_mib=16384, provision=False)
        assert vm.host == host
        if host == "h2":  # and the pair then fits on h1
            pair = c.request_vm("acme", "pair", [("A100-80GB", 2)], vcpus=16, memory_mib=65536, provision=False)
            assert pair.host == "h1"
    finally:
        c.close()


def test_pool_template_missing_is_refused_at_apply(ctl: Controller, tmp_path: Path) -> None:
    """A pool naming a template that is not in the template folders is refused when the inventory is applied
    (not at its first VM's provisioning), and nothing changes."""
    edited = _demo_edit(tmp_path, "    policy: pack\n    description: \"Small slices",
                        "    policy: pack\n    template: nosuch.xml.j2\n    description: \"Small slices")
    before = store_snapshot(ctl)
    with pytest.raises(InvalidInput) as err:
        ctl.apply_inventory(edited)
    assert "pool 'inference'" in err.value.message and "nosuch.xml.j2" in err.value.message
    assert err.value.reasons == [{"field": "pools.inference.template", "value": "nosuch.xml.j2"}]
    assert store_snapshot(ctl) == before
