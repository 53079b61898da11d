"""Choosing preemption victims by geometry (core.preemption): MIG starts, compute slices, mixed-size placement
ids, never a non-preemptible VM or one of equal priority, the smallest set, and a higher priority never refused
while lower preemptible VMs hold what it needs (hypothesis, against a brute force); a VM is borrowed when it and
its tenant's older work pass a guarantee, and a reclaim keeps every lender at or above its guarantee."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_ctl import load_catalog
from vgpu_ctl.core.geometry import Occupancy, geometry_for
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan_on_host
from vgpu_ctl.core.preemption import (
    Holder,
    borrowed_now,
    choose_victims,
    eligible,
    keeps_floor,
    reclaimable,
    victim_order,
    without,
)

CATALOG = load_catalog()
MIG = geometry_for(CATALOG, "H100-80GB", "mig")
MIXED = geometry_for(CATALOG, "L40S", "vgpu-mixed")


def host_with(geometry: object, placed: list[tuple[str, int]], gpu_id: int = 1, vcpus: float = 64,
              memory: float = 65536) -> HostView:
    occ = Occupancy(geometry)  # type: ignore[arg-type]
    for profile, start in placed:
        occ = occ.add(profile, start)
    return HostView(1, "h1", vcpus, memory, (GpuView(gpu_id, "0000:01:00.0", occ),), gpu_count=1)


def holder(name: str, start: int, priority: int = 10, preemptible: bool = True, admitted: float = 0.0,
           **kw: object) -> Holder:
    return Holder(name, 1, priority, preemptible, ((1, start),), 2, 1024, admitted, **kw)  # type: ignore[arg-type]


def req(profile: str) -> PlacementRequest:
    return PlacementRequest((profile,), 2, 1024)


def test_fits_as_it_is_needs_no_victims() -> None:
    host = host_with(MIG, [("1g.10gb", 0)])
    found = choose_victims(req("3g.40gb"), 100, [host], [holder("a", 0)])
    assert found is not None and found.victims == ()


def test_mig_start_decides_not_free_slices() -> None:
    # 1g at 0, 1, 4, 5: four slices free either way, but a 4g.40gb only starts at 0, so only the VMs at 0 and 1
    # make room; the newest (at 4 and 5) would free as many slices and not help.
    host = host_with(MIG, [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 4), ("1g.10gb", 5)])
    holders = [holder("a", 0, admitted=1), holder("b", 1, admitted=2), holder("c", 4, admitted=3),
               holder("d", 5, admitted=4)]
    found = choose_victims(req("4g.40gb"), 100, [host], holders)
    assert found is not None
    assert sorted(v.vm_id for v in found.victims) == ["a", "b"]
    assert found.plan.devices[0].start == 0


def test_newest_first_among_equal_smallest_sets() -> None:
    host = host_with(MIG, [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 4), ("1g.10gb", 5)])
    holders = [holder("a", 0, admitted=1), holder("b", 1, admitted=2), holder("c", 4, admitted=3),
               holder("d", 5, admitted=4)]
    found = choose_victims(req("3g.40gb"), 100, [host], holders)  # 3g starts at 0 or 4: either pair frees one
    assert found is not None and sorted(v.vm_id for v in found.victims) == ["c", "d"]


def test_lowest_priority_first() -> None:
    host = host_with(MIG, [("3g.40gb", 0), ("3g.40gb", 4)])
    holders = [holder("old-low", 0, priority=5, admitted=1), holder("new-mid", 4, priority=50, admitted=9)]
    found = choose_victims(req("3g.40gb"), 100, [host], holders)
    assert found is not None and [v.vm_id for v in found.victims] == ["old-low"]


def test_compute_slices_count() -> None:
    # seven 1g instances use all 7 compute slices: one 1g more needs one of them gone
    host = host_with(MIG, [("1g.10gb", s) for s in range(7)])
    holders = [holder(f"v{s}", s, admitted=s) for s in range(7)]
    found = choose_victims(req("1g.10gb"), 100, [host], holders)
    assert found is not None and [v.vm_id for v in found.victims] == ["v6"]


def test_never_non_preemptible_nor_equal_or_higher() -> None:
    host = host_with(MIG, [("7g.80gb", 0)])
    assert choose_victims(req("1g.10gb"), 100, [host], [holder("a", 0, preemptible=False, priority=1)]) is None
    assert choose_victims(req("1g.10gb"), 100, [host], [holder("a", 0, priority=100)]) is None
    assert choose_victims(req("1g.10gb"), 100, [host], [holder("a", 0, priority=500)]) is None
    found = choose_victims(req("1g.10gb"), 101, [host], [holder("a", 0, priority=100)])
    assert found is not None and [v.vm_id for v in found.victims] == ["a"]


def test_cool_down_protects_from_equal_requests() -> None:
    host = host_with(MIG, [("7g.80gb", 0)])
    protected = holder("a", 0, priority=10, protected_below=100)
    assert choose_victims(req("1g.10gb"), 100, [host], [protected]) is None
    assert choose_victims(req("1g.10gb"), 101, [host], [protected]) is not None


def test_mixed_size_placement_ids() -> None:
    # L40S-24C at 0 and 24; a 16C goes only at 0 or 32: freeing the VM at 24 makes room at 32
    host = host_with(MIXED, [("L40S-24C", 0), ("L40S-24C", 24)])
    holders = [holder("first", 0, admitted=5), holder("second", 24, admitted=1)]
    found = choose_victims(req("L40S-16C"), 100, [host], holders)
    assert found is not None and len(found.victims) == 1
    # the newest goes first when either would do
    assert found.victims[0].vm_id == "first"
    assert choose_victims(req("L40S-48C"), 100, [host], holders[:1]) is None  # one of two is not enough
    both = choose_victims(req("L40S-48C"), 100, [host], holders)
    assert both is not None and len(both.victims) == 2


def test_host_vcpus_count_too() -> None:
    host = host_with(MIG, [("1g.10gb", 0)], vcpus=1)
    h = Holder("a", 1, 10, True, ((1, 0),), 4, 0, 0.0)
    found = choose_victims(PlacementRequest(("1g.10gb",), 2, 0), 100, [host], [h])
    assert found is not None and [v.vm_id for v in found.victims] == ["a"]


def test_borrowed_first() -> None:
    host = host_with(MIG, [("3g.40gb", 0), ("3g.40gb", 4)])
    holders = [holder("lent", 0, priority=5), holder("borrowed", 4, priority=50, borrowed=True)]
    found = choose_victims(req("3g.40gb"), 100, [host], holders)
    assert found is not None and [v.vm_id for v in found.victims] == ["borrowed"]


_PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


@st.composite
def scenes(draw: st.DrawFn) -> tuple[HostView, list[Holder], str, int]:
    occ = Occupancy(MIG)
    holders = []
    for i in range(draw(st.integers(0, 7))):
        profile = draw(st.sampled_from(_PROFILES))
        starts = occ.fit_starts(profile) if occ.misfit(profile) is None else ()
        if not starts:
            continue
        start = draw(st.sampled_from(starts))
        occ = occ.add(profile, start)
        holders.append(Holder(f"v{i}", 1, draw(st.sampled_from([1, 10, 50, 100])), draw(st.booleans()),
                              ((1, start),), 1, 0, float(draw(st.integers(0, 100)))))
    host = HostView(1, "h1", 64, 65536, (GpuView(1, "0000:01:00.0", occ),), gpu_count=1)
    return host, holders, draw(st.sampled_from(_PROFILES)), draw(st.sampled_from([1, 10, 50, 100, 1000]))


def _fits(host: HostView, request: PlacementRequest, victims: tuple[Holder, ...]) -> bool:
    return plan_on_host(without(host, victims), request, get_policy("first-fit")) is not None


@settings(max_examples=300, deadline=None)
@given(scenes())
def test_smallest_allowed_set_and_never_waiting_needlessly(scene: tuple[HostView, list[Holder], str, int]) -> None:
    host, holders, profile, priority = scene
    request = req(profile)
    allowed = tuple(sorted((h for h in holders if eligible(h, priority)), key=victim_order))
    found = choose_victims(request, priority, [host], holders)
    # a brute force over every allowed subset, smallest first
    best = next((set(s) for n in range(len(allowed) + 1) for s in combinations(allowed, n)
                 if _fits(host, request, s)), None)
    if best is None:
        assert found is None  # nothing allowed makes room
        return
    assert found is not None  # a higher priority never waits while lower preemptible VMs hold what it needs
    assert all(eligible(v, priority) for v in found.victims)
    assert len(found.victims) == len(best)  # the smallest set
    assert _fits(host, request, found.victims)
    after = found.plan.occupancies[1]
    kept = {s.start for s in host.gpus[0].occupancy.slots} - {v.devices[0][1] for v in found.victims}
    assert kept <= {s.start for s in after.slots}  # the plan keeps every VM not preempted


# -- reclaim's finer rules: borrowed from usage as it stands, and a lender's floor (hypothesis) --------------------

_CHARGES = st.lists(st.fixed_dictionaries({"vgpus": st.integers(0, 3), "memory_mib": st.integers(0, 4)}),
                    max_size=8)
_GUARANTEE = st.fixed_dictionaries({"vgpus": st.integers(0, 6)}, optional={"memory_mib": st.integers(0, 8)})


@settings(max_examples=300, deadline=None)
@given(_CHARGES, _GUARANTEE)
def test_borrowed_is_the_newest_work_past_the_guarantee(charges: list[dict[str, int]],
                                                        guarantee: dict[str, int]) -> None:
    vms = [(f"v{i}", c) for i, c in enumerate(charges)]  # oldest first
    out = borrowed_now(vms, guarantee)
    n = len(vms) - len(out)
    assert out == {vm for vm, _ in vms[n:]}  # a suffix: the newest
    within = {r: sum(c.get(r, 0) for _, c in vms[:n]) for r in guarantee}
    assert all(within[r] <= g for r, g in guarantee.items())  # what is guaranteed fits the guarantee
    if n < len(vms):  # and the oldest borrowed VM would not
        assert any(within[r] + vms[n][1].get(r, 0) > g for r, g in guarantee.items())
    # released older work makes newer work guaranteed: never more borrowed after dropping the oldest VM
    assert borrowed_now(vms[1:], guarantee) <= out


@st.composite
def lenders(draw: st.DrawFn) -> tuple[HostView, list[Holder], dict[str, dict[str, Any]], str]:
    """A MIG GPU full of two lenders' VMs (each VM one vGPU and some memory), with their guarantees and which
    VMs are borrowed now; and a request's profile."""
    occ = Occupancy(MIG)
    placed: list[tuple[str, str, int, int]] = []  # (vm, tenant, start, memory)
    for i in range(draw(st.integers(1, 7))):
        profile = draw(st.sampled_from(["1g.10gb", "1g.10gb", "2g.20gb"]))
        starts = occ.fit_starts(profile) if occ.misfit(profile) is None else ()
        if not starts:
            continue
        start = draw(st.sampled_from(starts))
        occ = occ.add(profile, start)
        placed.append((f"v{i}", draw(st.sampled_from(["l1", "l2"])), start, draw(st.integers(1, 4)) * 1024))
    tenants: dict[str, dict[str, Any]] = {}
    for t in ("l1", "l2"):
        mine = [(vm, {"vgpus": 1, "memory_mib": mem}) for vm, tt, _, mem in placed if tt == t]
        guarantee = {"vgpus": draw(st.integers(0, 3)), "memory_mib": draw(st.integers(0, 4)) * 1024}
        used = {r: sum(c[r] for _, c in mine) for r in guarantee}
        tenants[t] = {"guarantee": guarantee, "used": used, "charges": dict(mine),
                      "borrowed": borrowed_now(mine, guarantee)}
    borrowed = set().union(*(t["borrowed"] for t in tenants.values()))
    holders = [Holder(vm, 1, 10, False, ((1, start),), 1, mem, float(i), vm in borrowed)
               for i, (vm, _t, start, mem) in enumerate(placed)]
    host = HostView(1, "h1", 64, 65536, (GpuView(1, "0000:01:00.0", occ),), gpu_count=1)
    return host, holders, tenants, draw(st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb"]))


@settings(max_examples=300, deadline=None)
@given(lenders())
def test_a_reclaim_never_takes_a_lender_below_its_guarantee(scene: tuple[HostView, list[Holder],
                                                                         dict[str, dict[str, Any]], str]) -> None:
    host, holders, tenants, profile = scene
    owner = {vm: t for t, d in tenants.items() for vm in d["charges"]}

    def floor(victims: Any) -> bool:
        freed: dict[str, dict[str, int]] = {}
        for v in victims:
            acc = freed.setdefault(owner[v.vm_id], {})
            for r, n in tenants[owner[v.vm_id]]["charges"][v.vm_id].items():
                acc[r] = acc.get(r, 0) + n
        return all(keeps_floor(tenants[t]["used"], tenants[t]["guarantee"], f) for t, f in freed.items())

    request = req(profile)
    found = choose_victims(request, 0, [host], holders, allowed=reclaimable, keep=floor)
    allowed = [h for h in holders if h.borrowed]
    best = next((s for n in range(len(allowed) + 1) for s in combinations(allowed, n)
                 if floor(s) and _fits(host, request, s)), None)
    if best is None:
        assert found is None
        return
    assert found is not None and len(found.victims) == len(best)  # found whenever some allowed set works
    assert all(v.borrowed for v in found.victims)  # only work borrowed now
    assert floor(found.victims)  # every lender keeps at least its guarantee (or what it had, if below)
    for t, d in tenants.items():
        lost = [v for v in found.victims if owner[v.vm_id] == t]
        for r, g in d["guarantee"].items():
            left = d["used"][r] - sum(d["charges"][v.vm_id][r] for v in lost)
            assert left >= min(d["used"][r], g), (t, r, left, g)
