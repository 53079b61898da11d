"""Host summaries (host_fit, migration 0009): the triggers keep them equal to the GPU rows through inventory changes,
claims, releases and mask refreshes; migration 0009 fills them on an old store and downgrades; doctor reports a
wrong one and `init` rebuilds it; multi-GPU requests and pack read whole hosts from them (a host split over two
modes of one model is still found); planning over one host per distinct state chooses what planning over all
does. Each summary knows its host's width (`gpus`, migration 0015), and pack's pages read the widest hosts first,
so the store places as the pure policy does where the narrow hosts come first in host order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from conftest import DEMO, check_store_invariants, write_inventory
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text
from test_geometry import geom

from vgpu_ctl import Controller, NoCapacity
from vgpu_ctl.core.geometry import Occupancy, encode_layout, profile_bit
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, TaskShape, get_policy, plan
from vgpu_ctl.ops.doctor import diagnose
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.fit_masks import summary_drift
from vgpu_ctl.store import migrate
from vgpu_ctl.store.engine import make_engine
from vgpu_ctl.store.tables import POOL


def drift(ctl: Controller) -> list[Any]:
    with ctl.engine.connect() as conn:
        return summary_drift(conn)


def summaries(ctl: Controller) -> dict[tuple[Any, ...], tuple[int, int]]:
    with ctl.engine.connect() as conn:
        return {tuple(r[:5]): (r[5], r[6]) for r in conn.execute(text(
            "SELECT host_id, pool_id, model, mode, bitval, n_fit, free_units FROM host_fit WHERE n_fit > 0"))}


def req(ctl: Controller, name: str, profile: str, n: int = 1, pool: str | None = None) -> Any:
    return ctl.request_vm("acme", name, [(profile, n)], vcpus=2, memory_mib=2048, pool=pool, provision=False)


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def test_summaries_follow_claims_releases_and_inventory(acme: Controller, tmp_path: Path) -> None:
    ctl = acme
    assert summaries(ctl) and drift(ctl) == []
    vms = [req(ctl, "a", "A100D-10C", 1, "inference"), req(ctl, "b", "3g.40gb", 1, "inference"),
           req(ctl, "c", "L40S-12C", 1, "workstations"), req(ctl, "d", "A100D-20C", 2, "training")]
    assert drift(ctl) == []
    check_store_invariants(ctl.engine)
    for vm in vms:
        ctl.release_vm(vm.id)
    assert drift(ctl) == []
    # moving a GPU to another pool, and removing a host, move and drop their summaries
    inv = DEMO.read_text()
    moved = inv.replace("mode: vgpu-mixed, pool: workstations}", "mode: vgpu-mixed, pool: training}", 1)
    assert moved != inv
    ctl.apply_inventory(write_inventory(tmp_path, moved))
    assert drift(ctl) == []
    before, rest = moved.split("  - name: kvm-h100-01", 1)
    gone = before + "  - name: kvm-l40s-01" + rest.split("  - name: kvm-l40s-01", 1)[1]
    with ctl.engine.connect() as conn:
        h100 = conn.execute(text("SELECT id FROM host WHERE name = 'kvm-h100-01'")).scalar_one()
    ctl.apply_inventory(write_inventory(tmp_path, gone, "gone.yaml"), prune=True)
    assert drift(ctl) == []
    with ctl.engine.connect() as conn:  # the removed host's rows are gone, not left at zero
        assert conn.execute(text("SELECT count(*) FROM host_fit WHERE host_id = :h"), {"h": h100}).scalar() == 0
    check_store_invariants(ctl.engine)


def width_drift(ctl: Controller) -> list[Any]:
    """The summaries whose width (`gpus`) is not their host's GPUs in the pool with their model and mode."""
    with ctl.engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT f.host_id, f.pool_id, f.model, f.mode, f.bitval, f.gpus, (SELECT count(*) FROM gpu g WHERE "
            "g.host_id = f.host_id AND g.pool_id = f.pool_id AND g.model = f.model AND g.mode = f.mode) AS want "
            "FROM host_fit f")).all())


def wrong_widths(ctl: Controller) -> list[Any]:
    return [r for r in width_drift(ctl) if r.gpus != r.want]


def test_widths_follow_inventory_claims_and_rebuilds(acme: Controller, tmp_path: Path) -> None:
    ctl = acme
    assert width_drift(ctl) and wrong_widths(ctl) == []
    assert {r.gpus for r in width_drift(ctl)} >= {1, 2}
    vms = [req(ctl, "a", "A100D-10C", 1, "inference"), req(ctl, "b", "3g.40gb", 1, "inference"),
           req(ctl, "d", "A100D-20C", 2, "training")]  # claims may add summary rows for new profile bits
    assert wrong_widths(ctl) == []
    for vm in vms:
        ctl.release_vm(vm.id)
    inv = DEMO.read_text()
    moved = inv.replace("mode: vgpu-mixed, pool: workstations}", "mode: vgpu-mixed, pool: training}", 1)
    ctl.apply_inventory(write_inventory(tmp_path, moved))  # a GPU to another pool: both groups recounted
    assert wrong_widths(ctl) == []
    with ctl.engine.begin() as conn:
        conn.execute(text("UPDATE host_fit SET gpus = 0, n_fit = n_fit + 1"))
    ctl.init(refresh_fit_masks=True)  # the rebuild of wrong summaries inserts every row again: each counts its width
    assert wrong_widths(ctl) == [] and drift(ctl) == []


NARROW_FIRST = ("pools:\n  - name: wide\n    policy: pack\n    demand:\n      - {profile: L40S-48C, weight: 1.0}\n"
                "      - {profile: L40S-48C, gpus: 2, weight: 1.0}\nhosts:\n") + "".join(
    f"""  - name: kvm-{i:02d}
    uri: simulated:///kvm-{i:02d}
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
""" + "".join(f'      - {{pci: "0000:{0x10 + j:02x}:00.0", model: L40S, mode: vgpu-equal, pool: wide}}\n'
              for j in range(8 if i == 9 else 2)) for i in range(10))


def test_pack_in_the_store_takes_the_wide_host_the_pure_policy_takes(state_dir: Path, store_url: str,
                                                                    tmp_path: Path) -> None:
    """Nine 2-GPU hosts come before an 8-GPU host in host order, more than a page of them: pack keeps the pairs
    for the typical 2-GPU task and takes a whole GPU on the wide host, and the store, whose pack pages read the
    widest hosts first, places there as pure planning over every host does (fullest-first pages of 8 hosts held
    only 2-GPU hosts)."""
    c = Controller(store_url)
    try:
        c.apply_inventory(write_inventory(tmp_path, NARROW_FIRST))
        c.create_tenant("acme")
        assert wrong_widths(c) == []
        with c.engine.connect() as conn:
            pool = conn.execute(select(POOL).where(POOL.c.name == "wide")).one()
            everything = alloc.all_candidates(conn, c.catalog, [pool.id], ["L40S-48C"], None, {pool.id: "wide"})
        policy = get_policy("pack", {TaskShape(("L40S-48C",)): 1.0, TaskShape(("L40S-48C",), 2): 1.0})
        want = plan(PlacementRequest(("L40S-48C",), 2, 2048),
                    [replace(h, gpu_count=len(h.gpus)) for h in everything.hosts], policy)
        assert want is not None and want.host == "kvm-09"
        assert req(c, "whole", "L40S-48C", 1, "wide").host == "kvm-09"
        check_store_invariants(c.engine)
    finally:
        c.close()


def test_summary_counts_gpus_and_free_units(acme: Controller) -> None:
    ctl = acme
    with ctl.engine.connect() as conn:
        host = conn.execute(text("SELECT id FROM host WHERE name = 'kvm-a100-01'")).scalar_one()
        gpus = conn.execute(text("SELECT g.id, g.model, g.mode, g.pool_id FROM gpu g JOIN pool p ON p.id = g.pool_id "
                                 "WHERE g.host_id = :h AND p.name = 'training' AND g.mode = 'vgpu-equal'"),
                            {"h": host}).all()
    assert len(gpus) == 2
    model, mode, pool_id = gpus[0].model, gpus[0].mode, gpus[0].pool_id
    key = (host, pool_id, model, mode, profile_bit(geom(model, mode), "A100D-40C"))
    axis = geom(model, mode).axis
    assert summaries(ctl)[key] == (2, 2 * axis)
    first = req(ctl, "big", "A100D-40C", 1, "training")
    assert first.host == "kvm-a100-01"
    # the GPU that took it still fits one more A100D-40C: counted with half its units
    assert summaries(ctl)[key] == (2, 2 * axis - axis // 2)
    second = req(ctl, "big2", "A100D-40C", 1, "training")
    same = first.devices[0].gpu == second.devices[0].gpu
    assert summaries(ctl)[key] == ((1, axis) if same else (2, axis))


def test_migration_0009_fills_summaries_and_downgrades(store_url: str, state_dir: Path) -> None:
    c = Controller(store_url)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        req(c, "a", "3g.40gb", 1, "inference")
        req(c, "b", "L40S-12C", 1, "workstations")
        want = summaries(c)
        command.downgrade(migrate.alembic_config(c.engine), "0008")
        with c.engine.connect() as conn:
            tables = set(c.engine.dialect.get_table_names(conn))
        assert "host_fit" not in tables and "fit_bit" not in tables
        # a claim made while the store is at 0008 (no triggers): the upgrade counts it from the GPU rows
        with c.engine.begin() as conn:
            conn.execute(text("UPDATE gpu SET fits = 0 WHERE pci_address = '0000:17:00.0'"))
    finally:
        c.close()
    engine = make_engine(store_url)
    try:
        command.upgrade(migrate.alembic_config(engine), "head")
        with engine.connect() as conn:
            assert summary_drift(conn) == []
            assert conn.execute(text("SELECT count(*) FROM host_fit WHERE gpus = 0")).scalar_one() == 0
            n = conn.execute(text("SELECT count(*) FROM host_fit")).scalar_one()
    finally:
        engine.dispose()
    assert n and n < len(want) + 64
    c = Controller(store_url)
    try:
        req(c, "c", "3g.40gb", 1, "inference")
        assert drift(c) == []
        check_store_invariants(c.engine)
    finally:
        c.close()


def test_doctor_reports_a_wrong_summary_and_init_rebuilds_it(acme: Controller) -> None:
    ctl = acme
    assert [r for r in diagnose(ctl) if r.problems] == []
    with ctl.engine.begin() as conn:
        conn.execute(text("UPDATE host_fit SET n_fit = n_fit + 3 WHERE host_id = (SELECT id FROM host WHERE "
                          "name = 'kvm-l40s-01')"))
    problems = {r.name: r.problems for r in diagnose(ctl)}
    assert [name for name, p in problems.items() if p] == ["host-summaries"]
    p = problems["host-summaries"][0]
    assert p.object == "host kvm-l40s-01" and "vgpuctl init" in p.fix and "but its GPUs give" in p.message
    ctl.init(refresh_fit_masks=True)
    assert drift(ctl) == [] and [r for r in diagnose(ctl) if r.problems] == []


def _pages(ctl: Controller, pool: str, profiles: tuple[str, ...], whole: bool = False) -> list[list[HostView]]:
    with ctl.engine.connect() as conn:
        p = conn.execute(select(POOL).where(POOL.c.name == pool)).one()
        preq = PlacementRequest(profiles, 1, 1024)
        return [page.hosts for page in alloc.candidate_pages(conn, ctl.catalog, preq, p.id,
                                                              get_policy(p.policy).order, {p.id: p.name},
                                                              whole_hosts=whole)]


def test_multi_gpu_and_pack_pages_are_whole_hosts(acme: Controller) -> None:
    ctl = acme
    vm = req(ctl, "a", "A100D-40C", 1, "training")
    for profiles, whole in ((("A100D-40C", "A100D-40C"), False), (("A100D-40C",), True)):
        hosts = _pages(ctl, "training", profiles, whole)[0]
        for h in hosts:
            with ctl.engine.connect() as conn:
                every = conn.execute(text("SELECT count(*) FROM gpu g JOIN pool p ON p.id = g.pool_id "
                                          "JOIN host h ON h.id = g.host_id WHERE p.name = 'training' "
                                          "AND h.name = :n"), {"n": h.name}).scalar_one()
            assert h.gpu_count == len(h.gpus) == every  # its passthrough GPU too: pack scores the whole host
        assert vm.host in {h.name for h in hosts}
    # a single-GPU page for a policy that scores GPUs alone stays a page of GPUs
    [first, *_] = _pages(ctl, "training", ("A100D-40C",), False)
    assert all(h.gpu_count is None for h in first)


SPLIT = """
pools:
  - {name: split, policy: pack}
hosts:
  - name: kvm-split
    uri: simulated:///kvm-split
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:01:00.0", model: L40S, mode: vgpu-equal, pool: split}
      - {pci: "0000:02:00.0", model: L40S, mode: vgpu-mixed, pool: split}
"""


def test_host_split_over_two_modes_still_takes_a_two_gpu_vm(state_dir: Path, store_url: str,
                                                             tmp_path: Path) -> None:
    """No single summary row of the host counts two GPUs for L40S-24C (one per mode): the grouping query still
    finds the host, so the request is placed instead of refused."""
    c = Controller(store_url)
    try:
        c.apply_inventory(write_inventory(tmp_path, SPLIT))
        c.create_tenant("acme")
        vm = req(c, "pair", "L40S-24C", 2, "split")
        assert sorted(d.gpu for d in vm.devices) == ["kvm-split/0000:01:00.0", "kvm-split/0000:02:00.0"]
        with pytest.raises(NoCapacity):
            req(c, "third", "L40S-48C", 2, "split")
        check_store_invariants(c.engine)
    finally:
        c.close()


L40S = geom("L40S", "vgpu-mixed")
L40S_EMPTY = Occupancy(L40S)
PROFILES = ("L40S-8C", "L40S-12C", "L40S-24C")


@st.composite
def fleets(draw: st.DrawFn) -> list[HostView]:
    """Hosts drawn from few states (so that several share one, or share their GPUs but not their vCPUs), each
    with 2 GPUs."""
    states = []
    for _ in range(draw(st.integers(1, 3))):
        gpus = []
        for _ in range(2):
            occ = L40S_EMPTY
            for p in draw(st.sampled_from(((), ("L40S-8C",), ("L40S-24C",), ("L40S-8C", "L40S-12C")))):
                starts = occ.placements(p) if occ.misfit(p) is None else ()
                if starts:
                    occ = occ.placed(p, starts[-1])
            gpus.append(occ)
        states.append((tuple(gpus), draw(st.sampled_from((3.0, 8.0, 64.0)))))
    hosts = []
    for i in range(draw(st.integers(1, 8))):
        occs, vcpus = states[draw(st.integers(0, len(states) - 1))]
        hosts.append(HostView(i + 1, f"h{i}", vcpus, 1e6, tuple(GpuView(10 * i + k, f"p{k}", o)
                                                                  for k, o in enumerate(occs)),
                              order=i + 1, gpu_count=2))
    return hosts




@settings(max_examples=150, deadline=None)
@given(fleets(), st.sampled_from(PROFILES), st.integers(1, 2), st.sampled_from(("pack", "best-fit", "spread",
                                                                                 "first-fit")))
def test_planning_over_distinct_states_chooses_the_same_plan(hosts: list[HostView], profile: str, n: int,
                                                             policy: str) -> None:
    preq = PlacementRequest((profile,) * n, 4, 1024)
    pol = get_policy(policy, {"L40S-8C": 1.0, "L40S-24C": 2.0} if policy == "pack" else None)
    distinct = alloc.distinct_states(hosts, preq)
    assert len(distinct) == len({(frozenset((g.occupancy, k) for k, g in enumerate(sorted(
        h.gpus, key=lambda g: encode_layout(g.occupancy.slots)))), h.free_vcpus) for h in hosts})
    assert plan(preq, distinct, pol) == plan(preq, hosts, pol)


def test_identical_empty_hosts_are_planned_once() -> None:
    hosts = [HostView(i, f"h{i}", 64, 1e6, (GpuView(i * 10, "p", L40S_EMPTY),), order=i, gpu_count=1)
             for i in range(1, 9)]
    preq = PlacementRequest(("L40S-8C",), 4, 1024)
    assert [h.name for h in alloc.distinct_states(hosts, preq)] == ["h1"]
    assert [h.name for h in alloc.distinct_states(hosts[::-1], preq)] == ["h1"]


def _fleet(hosts: int) -> str:
    return "pools:\n  - name: wide\n    policy: pack\nhosts:\n" + "".join(
        f"  - name: kvm-{i:03d}\n    uri: simulated:///kvm-{i:03d}\n    driver: simulated\n    vcpus: 64\n"
        "    memory_mib: 262144\n    gpus:\n" + "".join(
            f'      - {{pci: "0000:{0x10 + j:02x}:00.0", model: L40S, mode: vgpu-equal, pool: wide}}\n'
            for j in range(8)) for i in range(hosts))


def _steps_to_add_a_gpu(url: str) -> int:
    """SQLite's VM steps to insert one more GPU on the first host (the summary and width triggers included)."""
    import sqlite3
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    try:
        con.set_progress_handler(count, 1)
        con.execute("INSERT INTO gpu (host_id, pci_address, model, mode, pool_id, pinned_type, mig_layout, axis_units, "
                    "free_units, active_type, layout, device_count, version, fits, lacks) SELECT host_id, "
                    "'0000:ff:00.0', model, mode, pool_id, pinned_type, mig_layout, axis_units, free_units, "
                    "active_type, layout, device_count, version, fits, lacks FROM gpu ORDER BY id LIMIT 1")
        con.set_progress_handler(None, 1)
        con.rollback()
    finally:
        con.close()
    return steps


def test_a_gpu_insert_counts_its_host_not_its_pool(state_dir: Path, tmp_path: Path) -> None:
    """Migration 0018: the width triggers read the host's GPUs, so adding a GPU costs the same in a pool of 80 GPUs
    as in one of 1,600 (0015's count scanned the pool: `inventory apply` of 100k GPUs took 27 minutes)."""
    steps = []
    for hosts in (10, 200):
        url = f"sqlite:///{tmp_path / f'fleet-{hosts}.db'}"
        c = Controller(url)
        try:
            c.apply_inventory(write_inventory(tmp_path, _fleet(hosts)))
            assert wrong_widths(c) == []
        finally:
            c.close()
        steps.append(_steps_to_add_a_gpu(url))
    assert steps[1] < 1.2 * steps[0], steps
