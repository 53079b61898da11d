"""vgpuctl advise carving: per GPU the carving that places the most of a demand, changing only free GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.conftest import DEMO, REPO, Cli, store_snapshot
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.planning.carving import advise
from vgpu_ctl.planning.demand import load_demand, scaled
from vgpu_ctl.planning.fleet import Fleet, fleet_from_inventory, fleet_from_trace

DEMAND = REPO / "inventory" / "demo-demand.yaml"
TRACES = REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023"
CATALOG = load_catalog()


def advise_json(*args: str, code: int = 0) -> Any:
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["advise", "carving", *args, "-o", "json"])
    assert result.exit_code == code, (result.exit_code, result.output)
    return json.loads(result.stdout)


def test_advisor_beats_the_demo_carving() -> None:
    out = advise_json("--demand", str(DEMAND), "--fleet", str(DEMO))
    assert out["advised"]["placed_vms"] > out["today"]["placed_vms"]
    assert out["gain"]["vms"] == out["advised"]["placed_vms"] - out["today"]["placed_vms"] > 0
    assert out["candidates"][0]["name"] == "today"
    by = {(g["host"], g["pci"]): g for g in out["gpus"]}
    # The fixed 4g+2g+1g layout becomes two 3g instances; the A100D-10C pin gives way to A100D-20C.
    assert by[("kvm-h100-01", "0000:4c:00.0")]["advised"] == "mig 3g.40gb@0,3g.40gb@4"
    assert by[("kvm-h100-01", "0000:4c:00.0")]["action"] == "re-carve"
    assert by[("kvm-a100-01", "0000:81:00.0")]["advised"] == "vgpu-equal A100D-20C"
    assert out["move_first"] == []


def test_advice_is_legal_and_replayable() -> None:
    """Every advised carving is one NVIDIA allows: replaying the demand on it places what the advisor said."""
    fleet = fleet_from_inventory(DEMO, CATALOG)
    demand = load_demand(DEMAND, CATALOG)
    advice = advise(CATALOG, fleet, demand)
    for h in advice.advised.fleet.hosts:
        for g in h.gpus:
            occ = g.occupancy
            again = type(occ)(occ.geometry, (), occ.pinned_type, occ.fixed_layout)
            for s in occ.slots:
                again = again.add(s.profile, s.start)  # raises if not allowed
    assert advice.advised.placed_vms + advice.advised.refused_vms == demand.vms


def test_pool_limits_the_changes() -> None:
    out = advise_json("--demand", str(DEMAND), "--fleet", str(DEMO), "--pool", "inference")
    changed = {g["pool"] for g in out["gpus"] if g["action"] == "re-carve"}
    assert changed <= {"inference"}
    bad = advise_json("--demand", str(DEMAND), "--fleet", str(DEMO), "--pool", "nowhere", code=2)
    assert "field pool" in bad["error"]["message"] and "'nowhere'" in bad["error"]["message"]


def test_in_use_gpus_are_never_changed_and_listed_to_move(cli: Cli, tmp_path: Path) -> None:
    from vgpu_ctl import Controller
    # A VM on the inference A100 pinned to A100D-10C: the demand's A100D-20C needs that GPU re-pinned.
    cli.json("vm", "create", "--tenant", "acme", "--name", "small", "--profile", "A100D-10C", "--vcpus", "4",
             "--memory", "16GiB", "--pool", "inference")
    with Controller(cli.url) as c:
        before = store_snapshot(c)
    out = cli.json("advise", "carving", "--demand", str(DEMAND), "--from-store")
    row = next(g for g in out["gpus"] if g["pci"] == "0000:81:00.0")
    assert row["devices"] == 1 and row["action"] == "move VMs first"
    assert row["advised"] == "vgpu-equal A100D-20C"
    assert out["move_first"] == ["kvm-a100-01/0000:81:00.0"]
    assert all(g["action"] != "re-carve" for g in out["gpus"] if g["devices"])
    with Controller(cli.url) as c:
        assert store_snapshot(c) == before


def test_bad_demand_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("requests: [{profile: H100-9-99C, count: 2}]\n")
    out = advise_json("--demand", str(path), "--fleet", str(DEMO), code=2)
    assert "field requests[0].profile" in out["error"]["message"] and "'H100-9-99C'" in out["error"]["message"]


def test_trace_advice_compares_candidates_on_a_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    if not TRACES.is_dir():
        pytest.skip(f"no traces at {TRACES}")
    import vgpu_ctl.planning.carving as carving
    monkeypatch.setattr(carving, "SAMPLE_ABOVE", 300)
    fleet = fleet_from_trace(TRACES / "openb_node_list_gpu_node.csv", CATALOG)
    small = Fleet(fleet.hosts[::8], fleet.source)
    demand = scaled(load_demand(TRACES / "openb_pod_list_default.csv", CATALOG), small.gpu_count / 6212 * 1.1)
    advice = advise(CATALOG, small, demand)
    assert advice.advised.placed_share >= advice.today.placed_share
    assert {s.name for s in advice.scores if s.sampled} >= {"today", "all vgpu-mixed", "all mig"}
    finals = [s for s in advice.scores if not s.sampled]  # today's and the winner, on the whole fleet
    assert finals[0].name == "today" and advice.winner in {s.name for s in finals} and len(finals) <= 2
    assert "all passthrough" not in {s.name for s in advice.scores}  # no request names a whole GPU
    assert all(g.action in ("keep", "re-carve") for g in advice.gpus)
