"""vgpuctl plan: a demand replayed on a copy of a fleet (a file or the store), never touching the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import DEMO, REPO, Cli, store_snapshot
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.planning.demand import Ask, Demand, load_demand, scaled
from vgpu_ctl.planning.fleet import Fleet, fleet_from_inventory, fleet_from_trace
from vgpu_ctl.planning.replay import run
from vgpu_ctl.planning.whatif import make_plan

DEMAND = REPO / "inventory" / "demo-demand.yaml"
TRACES = REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023"
CATALOG = load_catalog()


def plan_json(*args: str, code: int = 0) -> Any:
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["plan", *args, "-o", "json"])
    assert result.exit_code == code, (result.exit_code, result.output)
    return json.loads(result.stdout)


def write(tmp_path: Path, text: str, name: str = "demand.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_demo_fleet_plan_places_and_explains_refusals() -> None:
    out = plan_json("--demand", str(DEMAND), "--fleet", str(DEMO))
    s = out["summary"]
    assert s["placed_vms"] + s["refused_vms"] == out["demand"]["vms"] == 29
    by = {r["request"]: r for r in out["requests"]}
    # The training H100 has a fixed 4g+2g+1g layout: no 3g slot for H100-3-40C.
    assert by["requests[1]"]["refused"] == 2
    assert by["requests[1]"]["reason"] == "1 GPU whose fixed MIG layout has no free slot for it"
    # The inference A100 is pinned to A100D-10C: A100D-20C can't go there.
    assert by["requests[4]"]["reason"] == "1 GPU holding (or pinned to) another vGPU type"
    assert by["requests[3]"]["placed"] == 12
    # The fixed-layout GPU (no 3g slot, 1 GPU) and slot 7 of an inference H100 full of 1g slices (1/8).
    assert out["stranded"]["MIG holes"] == pytest.approx(1.125)
    assert any("H100-80GB" in line and "pool training" in line for line in out["add_hosts"])
    assert out["still_refused_after_adding"] == 0


def test_declared_changes_turn_the_refusals_into_placements(tmp_path: Path) -> None:
    text = DEMAND.read_text() + """
changes:
  set_gpus:
    - {host: kvm-h100-01, pci: "0000:4c:00.0", model: H100-80GB, mode: mig, mig_layout: ["3g.40gb@0", "3g.40gb@4"]}
    - {pool: inference, model: A100-80GB, mode: vgpu-equal, vgpu_type: A100D-20C}
  add_hosts:
    - {name: extra, count: 1, vcpus: 64, memory: 512GiB, gpus: [{model: L40S, count: 2, mode: vgpu-mixed,
                                                                 pool: workstations}]}
"""
    out = plan_json("--demand", str(write(tmp_path, text)), "--fleet", str(DEMO))
    assert out["summary"]["refused_vms"] == 0
    assert out["fleet"]["hosts"] == 4 and out["fleet"]["gpus"] == 11
    assert out["add_hosts"] == []


def test_trace_demand_on_trace_fleet() -> None:
    if not TRACES.is_dir():
        pytest.skip(f"no traces at {TRACES}")
    catalog = CATALOG
    fleet = fleet_from_trace(TRACES / "openb_node_list_gpu_node.csv", catalog, "vgpu-mixed")
    assert fleet.gpu_count == 6212
    demand = scaled(load_demand(TRACES / "openb_pod_list_default.csv", catalog), 0.05)
    small = Fleet(fleet.hosts[::20], fleet.source)
    result = make_plan(catalog, small, demand)
    o = result.outcome
    assert o.placed_vms + o.refused_vms == demand.vms
    assert result.stranded["rounding to a profile"] > 0  # shares rounded up to profiles
    assert all(r.text for r in o.refusals.values())


@pytest.mark.parametrize(("text", "field", "value"), [
    ("requests: [{profile: NOPE-1C, count: 1}]", "requests[0].profile", "'NOPE-1C'"),
    ("requests: [{profile: A100D-10C, count: 0}]", "requests[0].count", "0"),
    ("requests: [{profile: A100D-10C, count: -3}]", "requests[0].count", "-3"),
    ("requests: [{profile: A100D-10C, count: 2.5}]", "requests[0].count", "2.5"),
    ("requests: [{profile: A100D-10C, count: true}]", "requests[0].count", "True"),
    ("requests: [{profile: A100D-10C, models: [B900]}]", "requests[0].models[0]", "'B900'"),
    ("requests: [{profile: A100D-10C, memory: lots}]", "requests[0].memory", "'lots'"),
    ("requests: [{gpu_share: 1.5}]", "requests[0].gpu_share", "1.5"),
    ("requests: [{profile: A100D-10C, colour: red}]", "requests[0].colour", None),
    ("requests: [{profile: A100D-10C, pool: nowhere}]", "requests[0].pool", "'nowhere'"),
    ("requests: []", "requests", None),
    ("requests: [{profile: A100D-10C}]\nchanges: {set_gpus: [{model: B900, mode: mig}]}",
     "changes.set_gpus[0].model", "'B900'"),
    ("requests: [{profile: A100D-10C}]\nchanges: {set_gpus: [{model: L40S, mode: mig}]}",
     "changes.set_gpus[0].mode", "'mig'"),
    ("requests: [{profile: A100D-10C}]\nchanges: {set_gpus: [{host: nope, mode: mig}]}", "changes.set_gpus[0]", None),
    ("requests: [{profile: A100D-10C}]\nchanges: {add_hosts: [{name: x, vcpus: 8, memory_mib: 1024, gpus: "
     "[{model: H100-80GB, mode: mig, mig_layout: ['3g.40gb@2']}]}]}", "changes.add_hosts[0].gpus[0]", None),
])
def test_bad_demand_names_field_and_value_exit_2(tmp_path: Path, text: str, field: str, value: str | None) -> None:
    out = plan_json("--demand", str(write(tmp_path, text)), "--fleet", str(DEMO), code=2)
    msg = out["error"]["message"]
    assert f"field {field}" in msg, msg
    if value is not None:
        assert value in msg, msg


@pytest.mark.parametrize(("args", "words"), [
    (["--demand", "/nonexistent/d.yaml", "--fleet", str(DEMO)], "cannot read"),
    (["--demand", str(DEMAND), "--fleet", "/nonexistent/f.yaml"], "cannot read"),
    (["--demand", str(DEMAND)], "--fleet FILE and --from-store"),
    (["--demand", str(DEMAND), "--fleet", str(DEMO), "--policy", "luck"], "unknown placement policy 'luck'"),
    (["--demand", str(DEMAND), "--fleet", str(DEMO), "--scale", "0"], "field scale"),
])
def test_bad_arguments_exit_2(args: list[str], words: str) -> None:
    out = plan_json(*args, code=2)
    assert words in out["error"]["message"]


def test_bad_yaml_is_an_error_with_its_line(tmp_path: Path) -> None:
    out = plan_json("--demand", str(write(tmp_path, "requests:\n  - {profile: [\n")), "--fleet", str(DEMO), code=2)
    assert "not valid YAML" in out["error"]["message"] and "demand.yaml:" in out["error"]["message"]


def test_from_store_reads_the_store_and_changes_nothing(cli: Cli, tmp_path: Path) -> None:
    from vgpu_ctl import Controller
    cli.json("vm", "create", "--tenant", "acme", "--name", "a", "--profile", "H100-1-10C", "--vcpus", "4",
             "--memory", "16GiB", "--pool", "inference")
    with Controller(cli.url) as c:
        before = store_snapshot(c)
    text = DEMAND.read_text() + "changes:\n  add_hosts: [{name: more, vcpus: 64, memory: 256GiB, gpus: " \
        "[{model: H100-80GB, count: 2, mode: mig, pool: training}]}]\n"
    out = cli.json("plan", "--demand", str(write(tmp_path, text)), "--from-store")
    assert out["fleet"]["source"].startswith("store ")
    h100 = next(r for r in out["allocation"] if (r["pool"], r["model"]) == ("inference", "H100-80GB"))
    assert h100["allocated"] >= 0.125  # the VM's 1g slice is there before the demand
    assert out["fleet"]["hosts"] == 4
    with Controller(cli.url) as c:
        assert store_snapshot(c) == before
    # A GPU holding a device can't be re-carved in a what-if either.
    bad = DEMAND.read_text() + "changes:\n  set_gpus: [{pool: inference, model: H100-80GB, mode: mig, " \
        "mig_layout: ['7g.80gb@0']}]\n"
    err = cli.json("plan", "--demand", str(write(tmp_path, bad, "bad.yaml")), "--from-store", code=2)
    assert "holds 1 device(s)" in err["error"]["message"]


def test_from_store_is_admin_only(cli: Cli, tmp_path: Path) -> None:
    token = cli("tenant", "token", "acme").stdout.strip().split()[-1]
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["--db", cli.url, "--token", token, "plan", "--demand", str(DEMAND),
                                      "--from-store", "-o", "json"])
    assert result.exit_code == 7, result.output
    assert "admin command" in json.loads(result.stdout)["error"]["message"]


def test_table_output_names_the_refusals() -> None:
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["plan", "--demand", str(DEMAND), "--fleet", str(DEMO), "-o", "wide"])
    assert result.exit_code == 0, result.output
    assert "fixed MIG layout has no free slot" in result.stdout
    assert "add 1 host of model H100-80GB" in result.stdout


# -- invariants --------------------------------------------------------------------------------------------------

PROFILES = ["A100D-10C", "A100D-20C", "A100D-40C", "A100-80GB", "H100-1-10C", "H100-3-40C", "H100-2-20C",
            "1g.10gb", "3g.40gb", "L40S-12C", "L40S-24C", "L40S-8C", "A100D-4-40C"]
POOLS = [None, "training", "inference", "workstations"]
ask = st.tuples(st.sampled_from(PROFILES), st.integers(1, 3), st.integers(1, 8), st.integers(0, 64),
                st.sampled_from(POOLS))


def _check_fleet(fleet: Fleet) -> None:
    for h in fleet.hosts:
        assert h.free_vcpus >= -1e-6 and h.free_memory_mib >= 0, h.name
        for g in h.gpus:
            occ = g.occupancy
            mask = 0
            for s in occ.slots:
                m = ((1 << s.size) - 1) << s.start
                assert not mask & m and s.start + s.size <= occ.geometry.axis, (h.name, g.pci, occ.slots)
                assert s.start in occ.geometry.shapes[s.profile].starts
                mask |= m
            if occ.geometry.homogeneous and occ.slots:
                assert len({s.profile for s in occ.slots}) == 1
            if occ.geometry.compute_capacity is not None:
                assert sum(occ.geometry.shapes[s.profile].compute for s in occ.slots) <= occ.geometry.compute_capacity


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ask, min_size=1, max_size=8), st.sampled_from(["pack", "first-fit", "best-fit", "spread"]))
def test_placed_plus_refused_is_the_demand_and_no_gpu_or_host_is_over(items: list[tuple[Any, ...]],
                                                                     policy: str) -> None:
    fleet = fleet_from_inventory(DEMO, CATALOG)
    asks = tuple(Ask(f"requests[{i}]", (p,), None, gpus, float(vcpus), float(mem) * 1024, pool)
                 for i, (p, gpus, _, vcpus, pool) in enumerate(items) for mem in [vcpus])
    counts = tuple(c for _, _, c, _, _ in items)
    order = tuple(i for i, c in enumerate(counts) for _ in range(c))
    outcome = run(CATALOG, fleet, Demand(asks, counts, order), policy)
    for i, c in enumerate(counts):
        assert outcome.placed[i] + outcome.refused[i] == c
        if outcome.refused[i]:
            assert outcome.refusals[i].text
    _check_fleet(outcome.fleet)
    placed_devices = sum(len(g.occupancy.slots) for h in outcome.fleet.hosts for g in h.gpus)
    assert placed_devices == sum(outcome.placed[i] * a.gpus for i, a in enumerate(asks))


def test_scaled_demand_keeps_shapes_and_order() -> None:
    d = load_demand(DEMAND, CATALOG)
    assert scaled(d, 2.0).vms == 2 * d.vms
    half = scaled(d, 0.5)
    assert half.vms == round(0.5 * d.vms) and sum(half.counts) == half.vms
    with pytest.raises(InvalidInput, match="field scale"):
        scaled(d, -1)


def test_from_store_on_a_missing_store_creates_nothing(tmp_path: Path) -> None:
    from vgpu_ctl.cli.main import app
    db = tmp_path / "none.db"
    result = CliRunner().invoke(app, ["--db", f"sqlite:///{db}", "plan", "--demand", str(DEMAND), "--from-store",
                                      "-o", "json"])
    assert result.exit_code == 2, result.output
    assert "no store there" in json.loads(result.stdout)["error"]["message"]
    assert not db.exists()


def test_a_draining_host_is_its_own_cause(cli: Cli, tmp_path: Path) -> None:
    cli.json("host", "cordon", "kvm-l40s-01")
    out = cli.json("plan", "--demand", str(DEMAND), "--from-store")
    ws = next(r for r in out["requests"] if "@workstations" in r["shape"])
    assert ws["placed"] == 0 and "cordoned (draining) host" in ws["reason"]
    assert out["stranded"]["hosts draining or down"] == pytest.approx(2.0)


def _brute(replay: Any, i: int) -> tuple[int, Any] | None:
    """The plan `core.placement.plan` picks over every host of every group the VM may use (the slow, obvious way)."""
    from vgpu_ctl.core.placement import plan, plan_on_host
    best: tuple[Any, int, Any] | None = None
    ask = replay.asks[i]
    for key, profile in replay.options[i]:
        req = replay.request(ask, profile)
        views = [replay.view(hi, key) for hi in range(len(replay.fleet.hosts))
                 if key in replay.members[hi] and replay.fleet.hosts[hi].state == "active"]
        found = plan(req, views, replay.policy)
        if found is None:
            continue
        score = plan_on_host(next(v for v in views if v.host_id == found.host_id), req, replay.policy)
        assert score is not None
        if best is None or score[0] < best[0]:
            best = (score[0], found.host_id, found.devices)
    return None if best is None else (best[1], best[2])


@pytest.mark.parametrize("policy", ["pack", "first-fit", "best-fit", "spread"])
def test_replay_picks_what_plan_over_every_host_picks(policy: str) -> None:
    """The replay prices one host per state (and remembers pack's costs): the same plans as plan() over all hosts."""
    import random

    from vgpu_ctl.planning.fleet import PlanGpu, PlanHost, carve
    from vgpu_ctl.planning.replay import Replay
    rng = random.Random(7)
    shapes = [("A100-80GB", "vgpu-equal"), ("H100-80GB", "mig"), ("L40S", "vgpu-mixed")]
    hosts = []
    for k in range(24):
        model, mode = shapes[k % 3]
        n = rng.choice([1, 2, 4])
        vcpus = float(rng.choice([16, 32, 64]))
        hosts.append(PlanHost(f"h{k}", vcpus, 262144.0, vcpus, 262144.0,
                              tuple(PlanGpu(f"0000:{j:02x}:00.0", model, None, carve(CATALOG, model, mode))
                                    for j in range(n))))
    fleet = Fleet(tuple(hosts))
    profiles = ["A100D-10C", "A100D-20C", "A100D-40C", "H100-1-10C", "H100-3-40C", "H100-2-20C", "L40S-12C",
                "L40S-24C", "L40S-8C"]
    asks = tuple(Ask(f"r{k}", (p,), None, rng.choice([1, 1, 1, 2]), float(rng.choice([2, 4, 8, 12])), 4096.0)
                 for k, p in enumerate(profiles))
    replay = Replay(CATALOG, fleet, asks, policy, [1.0] * len(asks))
    placed = 0
    for _ in range(220):
        i = rng.randrange(len(asks))
        want = _brute(replay, i)
        got = replay.place(i)
        assert (got and (got[0], got[1].devices)) == want
        placed += got is not None
    assert placed > 50
