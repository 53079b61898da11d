"""`vgpuctl status` and `vgpuctl vm create-many`: occupancy bars, what still fits, usage; plain when piped."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from opsfixtures import Store, cli, cli_json, clone, template_store

from vgpu_ctl import load_catalog
from vgpu_ctl.core.geometry import Occupancy, Slot, geometry_for
from vgpu_ctl.ops.status import cells_of, describe, fleet_status, occupancy_bar
from vgpu_ctl.service.allocation import occupancy_of


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def test_cells_cover_the_axis() -> None:
    assert cells_of(8) == [(i, i + 1) for i in range(8)]
    for axis in (16, 24, 48, 80, 141):
        cells = cells_of(axis)
        assert len(cells) == 20 if axis >= 20 else axis
        assert cells[0][0] == 0 and cells[-1][1] == axis
        assert all(a[1] == b[0] for a, b in itertools.pairwise(cells))


def test_mig_bar_shows_compute_slices_per_position() -> None:
    geom = geometry_for(load_catalog(), "H100-80GB", "mig")
    occ = Occupancy(geom).add("3g.40gb", 4).add("1g.10gb", 0)
    assert occupancy_bar(occ) == "[1···3333]"
    assert describe(Occupancy(geom)) == "[········]"


def test_framebuffer_bar_is_scaled() -> None:
    geom = geometry_for(load_catalog(), "L40S", "vgpu-mixed")
    shape = geom.shapes["L40S-12C"]
    occ = Occupancy(geom, (Slot(shape.starts[0], shape.size, "L40S-12C"),))
    bar = occupancy_bar(occ)
    assert len(bar) == 22 and bar.count("█") == 5 and bar.count("·") == 15  # 12 of 48 GB = 5 of 20 cells


def test_equal_size_shows_type_and_count() -> None:
    geom = geometry_for(load_catalog(), "A100-80GB", "vgpu-equal")
    occ = Occupancy(geom).add("A100D-10C", 0).add("A100D-10C", 10)
    assert describe(occ) == "A100D-10C ×2/8"
    assert describe(Occupancy(geom)) == "empty (any type)"


def test_status_json_rows_pools_and_tenants(store: Store) -> None:
    out = cli_json(store, "status", "--gpus")
    assert set(out) == {"summary", "gpus", "page", "pools", "tenants"}
    assert len(out["gpus"]) == 9 and out["page"] == {"offset": 0, "limit": 100, "total": 9}
    a100 = next(g for g in out["gpus"] if g["pci"] == "0000:81:00.0")
    assert a100["occupancy"] == "A100D-10C ×1/8" and a100["pool"] == "inference" and a100["devices"] == 1
    mig = next(g for g in out["gpus"] if g["mode"] == "mig" and g["devices"])
    assert "3333" in mig["occupancy"]
    assert {t["name"] for t in out["tenants"]} == {"acme", "globex"}
    acme = next(t for t in out["tenants"] if t["name"] == "acme")
    assert {"scope": "*", "resource": "vms", "used": 2, "limit": None, "guarantee": None, "borrowed": None} \
        in acme["usage"]


def test_pool_fits_are_sums_of_capacities_of_active_hosts(store: Store) -> None:
    ctl = store.ctl()
    try:
        before = {p["name"]: p["fits"] for p in fleet_status(ctl)["pools"]}
        rows = store.sql("SELECT g.model, g.mode, g.mig_layout, g.layout, g.pinned_type FROM gpu g "
                         "JOIN pool p ON p.id = g.pool_id WHERE p.name = 'inference'")
        expected: dict[str, int] = {}
        for model, mode, mig_layout, layout, pinned in rows:
            occ = occupancy_of(ctl.catalog, {"model": model, "mode": mode, "mig_layout": mig_layout,
                                             "layout": layout, "pinned_type": pinned})
            for p in occ.geometry.shapes:
                expected[p] = expected.get(p, 0) + occ.capacity(p)
        assert before["inference"] == dict(sorted(expected.items()))
        assert before["inference"]["A100D-10C"] == 7  # pinned GPU: 8 minus acme's 1
        ctl.request_vm("acme", "a3", [("A100D-10C", 1)], vcpus=1, memory_mib=1024, pool="inference")
        assert fleet_status(ctl, pool="inference")["pools"][0]["fits"]["A100D-10C"] == 6
        store.sql("UPDATE host SET state = 'draining' WHERE name = 'kvm-a100-01'")
        after = fleet_status(ctl, pool="inference")["pools"][0]["fits"]
        assert after["A100D-10C"] == 0 and after["3g.40gb"] == before["inference"]["3g.40gb"]
    finally:
        ctl.close()


def test_status_filters_and_unknown_names(store: Store) -> None:
    out = cli_json(store, "status", "--host", "kvm-l40s-01", "--gpus")
    assert {g["host"] for g in out["gpus"]} == {"kvm-l40s-01"}
    out = cli_json(store, "status", "--pool", "workstations", "--gpus")
    assert {g["pool"] for g in out["gpus"]} == {"workstations"} and [p["name"] for p in out["pools"]] == [
        "workstations"]
    assert cli(store, "status", "--pool", "nope").exit_code == 4
    assert cli(store, "status", "--host", "nope").exit_code == 4


def test_status_text_is_plain_when_piped(store: Store) -> None:
    res = cli(store, "status", "--gpus")
    assert res.exit_code == 0, res.output
    assert "\x1b[" not in res.output
    assert "kvm-h100-01" in res.output and "inference" in res.output and "acme" in res.output


def test_tenant_status_shows_no_gpus_and_only_itself(store: Store) -> None:
    out = cli_json(store, "status", "--gpus", token=store.tokens["acme"])
    assert out["gpus"] == [] and out["summary"] is None and [t["name"] for t in out["tenants"]] == ["acme"]
    assert out["pools"]


def test_create_many_places_until_quota_then_refuses(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("globex", {"vms": 4})
    finally:
        ctl.close()
    res = cli(store, "vm", "create-many", "--tenant", "globex", "--prefix", "w", "--number", "5",
              "--profile", "L40S-4C", "--vcpus", "1", "--memory", "1GiB", "--json")
    assert res.exit_code == 3
    import json
    out = json.loads(res.stdout)
    assert out["placed"] == ["w1", "w2", "w3"]
    assert [(r["name"], r["code"]) for r in out["refused"]] == [("w4", "quota_exceeded"), ("w5", "quota_exceeded")]
    res = cli(store, "vm", "create-many", "--tenant", "acme", "--prefix", "x-", "--number", "10",
              "--profile", "1g.10gb", "--vcpus", "1", "--memory", "1GiB", "--pool", "inference")
    assert res.exit_code == 0, res.output
    assert "placed 10" in res.output and "\x1b[" not in res.output
    assert len([v for v in cli_json(store, "vm", "list") if v["name"].startswith("x-")]) == 10


def test_create_many_stops_on_bad_input(store: Store) -> None:
    res = cli(store, "vm", "create-many", "--tenant", "nobody", "--prefix", "w", "--number", "3",
              "--profile", "L40S-4C", "--vcpus", "1", "--memory", "1GiB")
    assert res.exit_code == 4
