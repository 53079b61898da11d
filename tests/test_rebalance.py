"""vgpuctl rebalance --plan: the moves that free whole GPUs or hosts, computed on a copy with the real geometry."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import DEMO, REPO, Cli, check_store_invariants, store_snapshot, write_inventory
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.core.geometry import Mode
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost, carve, fleet_from_inventory
from vgpu_ctl.planning.rebalance import (
    Goal,
    PlanDevice,
    PlanVm,
    gpus_freed,
    hosts_freed,
    in_use_gpus,
    make_rebalance,
    move_from_dict,
    replay_moves,
)

CATALOG = load_catalog()
DEMAND = REPO / "inventory" / "demo-demand.yaml"


def fill(fleet: Fleet, seed: int, n: int, keep: float, frozen: float = 0.0,
         policy: str = "spread") -> tuple[Fleet, list[PlanVm]]:
    """The fleet with up to `n` VMs placed by `policy` (spread fragments), then a share `1 - keep` of them gone
    again; a share `frozen` of the rest is not movable."""
    rng = random.Random(seed)
    occ = {(hi, gi): g.occupancy for hi, h in enumerate(fleet.hosts) for gi, g in enumerate(h.gpus)}
    room = [[h.free_vcpus, h.free_memory_mib] for h in fleet.hosts]
    placed: list[tuple[PlanVm, int, list[tuple[int, PlanDevice]]]] = []
    pools = sorted(fleet.pools())
    for k in range(n):
        pool = rng.choice(pools)
        gpus = [(hi, gi, g) for hi, h in enumerate(fleet.hosts) for gi, g in enumerate(h.gpus) if g.pool == pool]
        _, _, g = rng.choice(gpus)
        shapes = sorted(g.occupancy.geometry.shapes)
        if not shapes:
            continue
        profile = rng.choice(shapes)
        count = 2 if rng.random() < 0.15 else 1
        vcpus, memory = rng.choice([2, 4, 8, 16]), rng.choice([4096, 16384, 65536])
        anti = "grp" if rng.random() < 0.1 else None
        req = PlacementRequest((profile,) * count, vcpus, memory, {}, anti)
        views = []
        for hi, h in enumerate(fleet.hosts):
            mine = tuple(GpuView(gi, gg.pci, occ[(hi, gi)], gg.pool) for gi, gg in enumerate(h.gpus)
                         if gg.pool == pool)
            if mine:
                groups = frozenset(v.anti_affinity for v, h2, _ in placed if h2 == hi and v.anti_affinity)
                views.append(HostView(hi, h.name, room[hi][0], room[hi][1], mine, h.state, h.labels, groups,
                                      order=hi))
        chosen = plan(req, views, get_policy(policy))
        if chosen is None:
            continue
        hi = chosen.host_id
        for gi, o in chosen.occupancies.items():
            occ[(hi, gi)] = o
        room[hi][0] -= vcpus
        room[hi][1] -= memory
        devs = [(d.gpu_id, PlanDevice(fleet.hosts[hi].gpus[d.gpu_id].pci, d.profile, d.start, d.size))
                for d in chosen.devices]
        vm = PlanVm(f"vm-{k:04d}", f"v{k}", "t", fleet.hosts[hi].name, pool, vcpus, memory,
                    tuple(sorted(d for _, d in devs)), {}, anti)
        placed.append((vm, hi, devs))
    kept = []
    for vm, hi, devs in placed:
        if rng.random() < keep:
            kept.append(replace(vm, movable=rng.random() >= frozen))
            continue
        for gi, d in devs:
            occ[(hi, gi)] = occ[(hi, gi)].remove(d.start)
        room[hi][0] += vm.vcpus
        room[hi][1] += vm.memory_mib
    hosts = []
    for hi, h in enumerate(fleet.hosts):
        gpus = tuple(PlanGpu(g.pci, g.model, g.pool, occ[(hi, gi)]) for gi, g in enumerate(h.gpus))
        hosts.append(replace(h, gpus=gpus, free_vcpus=room[hi][0], free_memory_mib=room[hi][1]))
    return replace(fleet, hosts=tuple(hosts)), kept


def holders(fleet: Fleet, vms: list[PlanVm]) -> dict[tuple[str, str], set[str]]:
    """(host, pci) -> the VMs with a vGPU there."""
    out: dict[tuple[str, str], set[str]] = {(h.name, g.pci): set() for h in fleet.hosts for g in h.gpus}
    for v in vms:
        for d in v.devices:
            out[(v.host, d.pci)].add(v.id)
    return out


def check_plan(fleet: Fleet, vms: list[PlanVm], goal: Goal, pool: str | None = None) -> Any:
    """Plan, then check it: its moves replayed with the geometry's checks give its fleet after; what it says it
    freed is empty; it moves exactly the VMs on what it freed (the fewest that free them), each once; empty GPUs
    (hosts) stay empty; immovable VMs stay."""
    p = make_rebalance(fleet, vms, goal, pool)
    after = replay_moves(fleet, vms, p.moves)
    assert after == p.after
    for h in after.hosts:
        assert h.free_vcpus >= -1e-9 and h.free_memory_mib >= -1e-9
    by = holders(fleet, vms)
    moved = [m.vm for m in p.moves]
    assert len(moved) == len(set(moved)), "a VM moved twice"
    on_freed: set[str] = set()
    hosts = {h.name: h for h in after.hosts}
    for f in p.freed:
        if f.pci is None:
            assert not any(g.in_use for g in hosts[f.host].gpus)
            on_freed |= set().union(*(by[(f.host, g.pci)] for g in hosts[f.host].gpus))
        else:
            assert not next(g for g in hosts[f.host].gpus if g.pci == f.pci).in_use
            on_freed |= by[(f.host, f.pci)]
        assert f.vms, "a freed target that held nothing"
    assert set(moved) == on_freed, "the plan moves VMs that do not hold what it frees"
    assert {m.vm for m in p.moves} <= {v.id for v in vms if v.movable}
    for hb, ha in zip(fleet.hosts, after.hosts, strict=True):
        for gb, ga in zip(hb.gpus, ha.gpus, strict=True):
            if goal is not Goal.FREE_HOSTS:
                assert gb.in_use or not ga.in_use, "a move took an empty GPU"
            if pool is not None and gb.pool != pool and f"{hb.name}/{gb.pci}" in {f.name for f in p.freed}:
                raise AssertionError("freed a GPU of another pool")
        if goal is Goal.FREE_HOSTS:
            assert any(g.in_use for g in hb.gpus) or not any(g.in_use for g in ha.gpus)
    if goal is Goal.FREE_GPUS:
        assert gpus_freed(fleet, after) >= len(p.freed)
        assert in_use_gpus(after) == in_use_gpus(fleet) - gpus_freed(fleet, after)
    else:
        assert hosts_freed(fleet, after) >= len(p.freed)
    return p


def _demo_with_vms() -> tuple[Fleet, list[PlanVm]]:
    """The demo fleet with VMs spread out: 3 L40S vGPUs over both L40S GPUs, 1g slices on both inference H100s."""
    fleet = fleet_from_inventory(DEMO, CATALOG)
    spots = [("kvm-l40s-01", "0000:17:00.0", "L40S-8C", 0), ("kvm-l40s-01", "0000:17:00.0", "L40S-8C", 16),
             ("kvm-l40s-01", "0000:ca:00.0", "L40S-8C", 0), ("kvm-h100-01", "0000:19:00.0", "H100-1-10C", 0),
             ("kvm-h100-01", "0000:19:00.0", "H100-1-10C", 1), ("kvm-h100-01", "0000:3b:00.0", "H100-1-10C", 0)]
    hosts = list(fleet.hosts)
    vms = []
    for n, (host, pci, profile, start) in enumerate(spots):
        hi = next(i for i, h in enumerate(hosts) if h.name == host)
        h = hosts[hi]
        gi = next(i for i, g in enumerate(h.gpus) if g.pci == pci)
        g = h.gpus[gi]
        occ = g.occupancy.add(profile, start)
        gpus = list(h.gpus)
        gpus[gi] = replace(g, occupancy=occ)
        hosts[hi] = replace(h, gpus=tuple(gpus), free_vcpus=h.free_vcpus - 4, free_memory_mib=h.free_memory_mib - 16384)
        size = occ.geometry.shapes[profile].size
        vms.append(PlanVm(f"id-{n}", f"vm{n}", "acme", host, g.pool, 4, 16384,
                          (PlanDevice(pci, profile, start, size),)))
    return replace(fleet, hosts=tuple(hosts)), vms


def test_demo_fleet_frees_gpus_with_one_vm_each() -> None:
    fleet, vms = _demo_with_vms()
    p = check_plan(fleet, vms, Goal.FREE_GPUS)
    assert sorted(f.name for f in p.freed) == ["kvm-h100-01/0000:3b:00.0", "kvm-l40s-01/0000:ca:00.0"]
    assert [len(f.vms) for f in p.freed] == [1, 1]
    data = p.to_dict()
    assert data["summary"]["gpus_freed"] == 2 and data["summary"]["vms_moved"] == 2
    assert data["summary"]["in_use_gpus_before"] == 4 and data["summary"]["in_use_gpus_after"] == 2
    # The H100 slice lands at a MIG start the geometry allows, beside the others; the L40S vGPU at a mixed-size
    # placement id left free.
    to = {m.frees: m.to_devices[0] for m in p.moves}
    assert to["kvm-h100-01/0000:3b:00.0"] == PlanDevice("0000:19:00.0", "H100-1-10C", 2, 1)
    assert to["kvm-l40s-01/0000:ca:00.0"].pci == "0000:17:00.0"
    assert to["kvm-l40s-01/0000:ca:00.0"].start in CATALOG.profile("L40S", "L40S-8C").mixed_placement_ids
    # Round trip of a move through its plain form.
    assert [move_from_dict(m) for m in data["moves"]] == list(p.moves)


def test_demo_fleet_nothing_to_free_for_hosts_and_an_immovable_vm_stays() -> None:
    fleet, vms = _demo_with_vms()
    p = check_plan(fleet, vms, Goal.FREE_HOSTS)
    assert p.freed == () and p.moves == ()  # every host's VMs have nowhere else in their pools
    stuck = [replace(v, movable=False) if v.name == "vm2" else v for v in vms]
    p = check_plan(fleet, stuck, Goal.FREE_GPUS)
    # vm2 stays on 0000:ca:00.0, so the other L40S is freed instead, for two VMs moved.
    assert {f.name: len(f.vms) for f in p.freed} == {"kvm-h100-01/0000:3b:00.0": 1, "kvm-l40s-01/0000:17:00.0": 2}
    assert all(m.vm != "id-2" for m in p.moves)


def test_pool_restricts_what_is_freed() -> None:
    fleet, vms = _demo_with_vms()
    p = check_plan(fleet, vms, Goal.FREE_GPUS, pool="workstations")
    assert [f.name for f in p.freed] == ["kvm-l40s-01/0000:ca:00.0"]


def test_bad_goal_pool_and_targets_name_the_field() -> None:
    fleet, vms = _demo_with_vms()
    with pytest.raises(InvalidInput, match="field goal"):
        make_rebalance(fleet, vms, "tidy")
    with pytest.raises(InvalidInput, match="field pool"):
        make_rebalance(fleet, vms, Goal.FREE_GPUS, "nope")
    with pytest.raises(InvalidInput, match="field goal"):
        make_rebalance(fleet, vms, Goal.ADVISED)
    with pytest.raises(InvalidInput, match="field targets"):
        make_rebalance(fleet, vms, Goal.ADVISED, targets=[("kvm-a100-01", "0000:00:00.0")])


def test_replay_refuses_a_move_the_geometry_refuses() -> None:
    fleet, vms = _demo_with_vms()
    p = make_rebalance(fleet, vms, Goal.FREE_GPUS)
    m = next(m for m in p.moves if m.frees.startswith("kvm-h100"))
    bad = replace(m, to_devices=(PlanDevice("0000:19:00.0", "H100-1-10C", 0, 1),))  # taken by vm3
    with pytest.raises(InvalidInput, match="does not fit"):
        replay_moves(fleet, vms, [bad])


MODELS = [("A100-80GB", Mode.VGPU_EQUAL), ("A100-80GB", Mode.MIG), ("H100-80GB", Mode.MIG),
          ("H100-80GB", Mode.VGPU_EQUAL), ("L40S", Mode.VGPU_MIXED), ("L40S", Mode.VGPU_EQUAL)]


@st.composite
def fleets(draw: Any) -> Fleet:
    """Random fleets: 1-5 hosts of 1-4 GPUs, each of a random model and mode in one of two pools."""
    hosts = []
    for hi in range(draw(st.integers(1, 5))):
        gpus = []
        for gi in range(draw(st.integers(1, 4))):
            model, mode = draw(st.sampled_from(MODELS))
            gpus.append(PlanGpu(f"0000:{0x10 + gi:02x}:00.0", model, draw(st.sampled_from(["p1", "p2"])),
                                carve(CATALOG, model, mode)))
        vcpus = float(draw(st.sampled_from([16, 32, 64])))
        memory = float(draw(st.sampled_from([65536, 262144])))
        hosts.append(PlanHost(f"h{hi}", vcpus, memory, vcpus, memory, tuple(gpus),
                              draw(st.sampled_from(["active"] * 5 + ["draining"]))))
    return Fleet(tuple(hosts), "generated")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), st.integers(0, 10_000), st.integers(4, 40), st.floats(0.2, 0.8),
       st.sampled_from([Goal.FREE_GPUS, Goal.FREE_HOSTS]), st.sampled_from([None, "p1"]))
def test_random_fleets_plans_hold(fleet: Fleet, seed: int, n: int, keep: float, goal: Goal,
                                  pool: str | None) -> None:
    filled, vms = fill(fleet, seed, n, keep, frozen=0.1)
    if pool is not None and pool not in filled.pools():
        pool = None
    check_plan(filled, vms, goal, pool)


def test_generated_fleet_frees_many_gpus() -> None:
    hosts = tuple(PlanHost(f"h{i}", 256.0, 1048576.0, 256.0, 1048576.0,
                           tuple(PlanGpu(f"0000:{0x10 + j:02x}:00.0", "H100-80GB", "p", carve(CATALOG, "H100-80GB",
                                                                                                   Mode.MIG))
                                 for j in range(4))) for i in range(6))
    filled, vms = fill(Fleet(hosts, "generated"), 7, 60, 0.4)
    p = check_plan(filled, vms, Goal.FREE_GPUS)
    freed = gpus_freed(filled, p.after)
    assert freed >= 3, p.to_dict()["summary"]  # 18 in use, many half empty: several GPUs can be emptied
    assert freed >= len(p.freed) and freed == p.to_dict()["summary"]["gpus_freed"]
    assert p.vms_moved == sum(len(f.vms) for f in p.freed)
    ph = check_plan(filled, vms, Goal.FREE_HOSTS)
    assert hosts_freed(filled, ph.after) == len(ph.freed) >= 1


# -- the command, on a store --------------------------------------------------------------------------------------

def _spread_workstations(cli: Cli) -> None:
    for n in range(3):  # the workstations pool spreads: two on one L40S, one on the other
        cli.json("vm", "create", "--tenant", "acme", "--name", f"w{n}", "--profile", "L40S-8C", "--vcpus", "4",
                 "--memory", "16GiB", "--pool", "workstations")


def test_plan_on_the_store_changes_nothing(cli: Cli) -> None:
    from vgpu_ctl import Controller
    _spread_workstations(cli)
    with Controller(cli.url) as c:
        before = store_snapshot(c)
    out = cli.json("rebalance", "--plan")
    assert out["fleet"].startswith("store ")
    assert out["summary"]["gpus_freed"] == 1 and out["summary"]["vms_moved"] == 1
    assert out["freed"][0]["vms_touched"] == 1
    (move,) = out["moves"]
    assert move["from"]["host"] == move["to"]["host"] == "kvm-l40s-01"
    assert move["from"]["devices"][0]["pci"] != move["to"]["devices"][0]["pci"]
    table = cli("rebalance", "--plan", "--pool", "workstations")
    assert table.exit_code == 0, table.output
    assert "1 move of 1 VM free 1 GPU" in table.stdout
    yaml_out = cli("rebalance", "--plan", "-o", "yaml")
    assert yaml_out.exit_code == 0 and "gpus_freed: 1" in yaml_out.stdout
    with Controller(cli.url) as c:
        assert store_snapshot(c) == before


@pytest.mark.parametrize(("args", "field"), [
    (["--plan", "--goal", "tidy"], "goal"),
    (["--plan", "--pool", "nope"], "pool"),
    (["--plan", "--goal", "advised"], "demand"),
    (["--plan", "--demand", str(DEMAND)], "demand"),
    ([], "plan"),
    (["--plan", "--apply"], "plan"),
])
def test_bad_input_is_exit_2_naming_the_field(cli: Cli, args: list[str], field: str) -> None:
    from vgpu_ctl import Controller
    _spread_workstations(cli)
    with Controller(cli.url) as c:
        before = store_snapshot(c)
    err = cli.json("rebalance", *args, code=2)
    assert f"field {field}" in err["error"]["message"]
    with Controller(cli.url) as c:
        assert store_snapshot(c) == before


def test_a_tenant_token_is_refused_exit_7(cli: Cli) -> None:
    token = cli("tenant", "token", "acme").stdout.strip().split()[-1]
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["--db", cli.url, "--token", token, "rebalance", "--plan", "-o", "json"])
    assert result.exit_code == 7, result.output
    assert "admin command" in json.loads(result.stdout)["error"]["message"]


def test_refused_with_server() -> None:
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["--server", "http://127.0.0.1:9", "--token", "x", "rebalance", "--plan",
                                      "-o", "json"])
    assert result.exit_code == 2, result.output
    assert "--server" in json.loads(result.stdout)["error"]["message"]


def test_goal_advised_frees_what_the_advisor_wants_recarved(cli: Cli) -> None:
    # A 1g slice on the training H100's fixed 4g+2g+1g layout keeps the advisor from re-carving it to 3g+3g.
    cli.json("vm", "create", "--tenant", "acme", "--name", "t1", "--profile", "H100-1-10C", "--vcpus", "4",
             "--memory", "16GiB", "--pool", "training")
    advice = cli.json("advise", "carving", "--demand", str(DEMAND), "--from-store")
    out = cli.json("rebalance", "--plan", "--goal", "advised", "--demand", str(DEMAND))
    wanted = set(advice["move_first"])
    assert "kvm-h100-01/0000:4c:00.0" in wanted
    # Every GPU the advisor wants emptied is either freed or said why not (here: no other training GPU in use
    # offers the 1g slice, so it stays).
    assert {f["target"] for f in out["freed"]} | {b["target"] for b in out["blocked"]} == wanted
    assert out["moves"] == []


ADVISED_FLEET = """
pools:
  - {name: p, policy: pack}
hosts:
  - name: sim-h
    uri: "simulated:///sim-h"
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:19:00.0", model: H100-80GB, mode: mig, pool: p,
         mig_layout: ["4g.40gb@0", "2g.20gb@4", "1g.10gb@6"]}
      - {pci: "0000:3b:00.0", model: H100-80GB, mode: mig, pool: p}
"""


def test_goal_advised_empties_the_gpu_whose_layout_keeps_the_demand_out(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl import Controller
    from vgpu_ctl.planning.carving import advise
    from vgpu_ctl.planning.demand import load_demand
    from vgpu_ctl.service.fleet_snapshot import fleet_snapshot

    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    demand_file = tmp_path / "demand.yaml"
    demand_file.write_text("requests:\n  - {profile: H100-3-40C, count: 4, vcpus: 4, memory: 16GiB, pool: p}\n")
    with Controller(f"sqlite:///{tmp_path / 'a.db'}", state_path=tmp_path) as c:
        c.apply_inventory(write_inventory(tmp_path, ADVISED_FLEET))
        c.create_tenant("acme")
        for name in ("x", "y"):  # a 1g slice on each: the fixed 4g+2g+1g layout can never take a 3g
            c.request_vm("acme", name, "H100-1-10C", vcpus=4, memory_mib=16384)
        demand = load_demand(demand_file, c.catalog)
        before = store_snapshot(c)
        advice = advise(c.catalog, fleet_snapshot(c), demand)
        wanted = [f"{g.host}/{g.pci}" for g in advice.gpus if g.action == "move VMs first"]
        assert wanted == ["sim-h/0000:19:00.0"]
        p = c.rebalance_plan("advised", demand=demand)
        assert [f.name for f in p.freed] == wanted and p.vms_moved == 1
        assert store_snapshot(c) == before
        # Pack puts the slice where the other GPU can still take a 3g (not at start 0, which best-fit would take).
        other = next(g for g in p.after.hosts[0].gpus if g.pci == "0000:3b:00.0")
        assert other.occupancy.misfit("H100-3-40C") is None
        assert c.rebalance_apply(p.moves)["done"]
        check_store_invariants(c.engine)
        assert c.rebalance_plan("advised", demand=demand).moves == ()
