"""The pack policy: fragmentation measured per host against typical task shapes (FGD), ties to host order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vgpu_ctl import load_catalog
from vgpu_ctl.core.geometry import Geometry, Occupancy, geometry_for
from vgpu_ctl.core.placement import (
    Demand,
    GpuView,
    HostView,
    PlacementRequest,
    TaskShape,
    get_policy,
    plan,
    plan_on_host,
)

CATALOG = load_catalog()
A100 = geometry_for(CATALOG, "A100-80GB", "vgpu-equal")
A100_MIG = geometry_for(CATALOG, "A100-80GB", "mig")
T4 = geometry_for(CATALOG, "T4", "vgpu-equal")
H100_MIG = geometry_for(CATALOG, "H100-80GB", "mig")


def occ(g: Geometry, *placements: tuple[str, int]) -> Occupancy:
    o = Occupancy(g)
    for profile, start in placements:
        o = o.add(profile, start)
    return o


def host(i: int, *gpus: Occupancy, vcpus: float = 64, memory: float = 256 * 1024) -> HostView:
    views = tuple(GpuView(j, f"h{i}/{j}", o) for j, o in enumerate(gpus))
    return HostView(i, f"h{i}", vcpus, memory, views, order=i)


def where(req: PlacementRequest, hosts: list[HostView], policy: str, demand: Demand | None = None) -> tuple[int, int]:
    p = plan(req, hosts, get_policy(policy, demand))
    assert p is not None
    return p.host_id, p.devices[0].gpu_id


@pytest.mark.parametrize("short", ["vcpus", "memory"])
def test_keeps_a_host_whose_leftover_vcpus_or_memory_still_admit_typical_tasks(short: str) -> None:
    small = {"vcpus": 6} if short == "vcpus" else {"memory": 6 * 1024}
    hosts = [host(0, occ(A100), occ(A100), **small), host(1, occ(A100), occ(A100))]
    req = PlacementRequest(("A100D-20C",), 4, 4 * 1024)
    demand = {TaskShape(("A100D-20C",), vcpus=4, memory_mib=4 * 1024): 1.0}
    # on h0 the request leaves 2 vCPUs (or 2 GiB): no typical task fits there any more, its GPUs would be stranded
    assert where(req, hosts, "pack", demand) == (1, 0)
    assert where(req, hosts, "first-fit") == (0, 0)
    # a typical task needing nothing besides its GPU sees no difference: ties go to host order
    assert where(req, hosts, "pack", {TaskShape(("A100D-20C",)): 1.0}) == (0, 0)


def test_keeps_two_free_gpus_together_for_two_gpu_tasks() -> None:
    full = occ(A100, ("A100D-80C", 0))
    hosts = [host(0, occ(A100), occ(A100)), host(1, full, occ(A100))]
    req = PlacementRequest(("A100D-80C",), 4, 1024)
    demand = {TaskShape(("A100D-80C",), gpus=2): 1.0, TaskShape(("A100D-80C",)): 1.0}
    assert where(req, hosts, "pack", demand) == (1, 1)
    # per GPU both empty GPUs look the same: without the 2-GPU shape the first host wins
    assert where(req, hosts, "pack", {"A100D-80C": 1.0}) == (0, 0)
    assert where(req, hosts, "best-fit") == (0, 0)


def test_multi_gpu_plan_scores_the_whole_host() -> None:
    demand = {TaskShape(("A100D-80C",), gpus=2): 1.0, TaskShape(("A100D-40C",)): 1.0}
    req = PlacementRequest(("A100D-40C", "A100D-40C"), 4, 1024)
    half = occ(A100, ("A100D-40C", 0))
    # h0: two half-used GPUs that only 40C tasks can use; h1: two empty GPUs a 2-GPU task needs whole
    hosts = [host(0, occ(A100), occ(A100)), host(1, half, half)]
    p = plan(req, hosts, get_policy("pack", demand))
    assert p is not None and p.host_id == 1 and {d.gpu_id for d in p.devices} == {0, 1}
    scored = plan_on_host(hosts[0], req, get_policy("pack", demand))
    assert scored is not None and scored[0][0] > 0  # h0 would lose its pair of whole GPUs


def test_a_gpu_no_typical_task_can_run_on_holds_no_fragment() -> None:
    # 7g.80gb tasks can never run on a T4: its free share is nobody's fragment, so filling it gains nothing
    # (FGD counted all of it, which drew tasks that could run elsewhere onto the models the fewest tasks can use)
    a100, t4 = host(0, occ(A100_MIG)), host(1, occ(T4))
    on_t4 = plan_on_host(t4, PlacementRequest(("T4-16C",), 1, 1024), get_policy("pack", {"7g.80gb": 1.0}))
    on_a100 = plan_on_host(a100, PlacementRequest(("7g.80gb",), 1, 1024), get_policy("pack", {"7g.80gb": 1.0}))
    assert on_t4 is not None and on_a100 is not None
    assert on_t4[0][0] == 0.0 and on_a100[0][0] == 0.0


def test_a_shape_counts_only_on_the_models_it_may_run_on() -> None:
    h100 = host(0, occ(H100_MIG))
    req = PlacementRequest(("1g.10gb",), 1, 1024)
    anywhere = plan_on_host(h100, req, get_policy("pack", {TaskShape(("7g.80gb",)): 1.0}))
    only = frozenset({"A100-80GB"})
    a100_only = plan_on_host(h100, req, get_policy("pack", {TaskShape(("7g.80gb",), models=only): 1.0}))
    assert anywhere is not None and a100_only is not None
    assert anywhere[0][0] == 0.875  # a 1g instance leaves no room for a 7g: the other 7/8 are stranded
    assert a100_only[0][0] == 0.0  # the H100 is nothing to a task that may only run on an A100


def test_multi_gpu_tasks_see_no_fragment_on_hosts_too_small_for_them() -> None:
    demand = {TaskShape(("A100D-80C",), gpus=2): 1.0}
    req = PlacementRequest(("A100D-80C",), 1, 1024)
    pack = get_policy("pack", demand)
    narrow = plan_on_host(replace(host(0, occ(A100)), gpu_count=1), req, pack)
    wide = plan_on_host(replace(host(1, occ(A100, ("A100D-80C", 0)), occ(A100)), gpu_count=2), req, pack)
    assert narrow is not None and wide is not None
    assert narrow[0][0] == 0.0  # a one-GPU host never runs a 2-GPU task
    assert wide[0][0] == -1.0  # the lone free GPU of a 2-GPU host was a fragment for them
    # a view of only some of a host's GPUs (the store's candidate page) does not say how wide the host is
    partial = plan_on_host(host(0, occ(A100)), req, pack)
    assert partial is not None and partial[0][0] == -1.0


def test_scarce_models_room_is_left_to_the_demand_that_can_run_only_there() -> None:
    # 7g.80gb runs on A100-80GB and H100-80GB; half the demand may only use the one H100 of nine GPUs
    demand = {TaskShape(("7g.80gb",)): 1.0, TaskShape(("7g.80gb",), models=frozenset({"H100-80GB"})): 1.0}
    hosts = [host(0, occ(H100_MIG)), host(1, occ(A100_MIG))]
    req = PlacementRequest(("7g.80gb",), 1, 1024)
    assert where(req, hosts, "pack", demand) == (0, 0)  # without the supply both cost nothing: host order
    scarce = plan(req, hosts, get_policy("pack", demand, {"H100-80GB": 1, "A100-80GB": 8}))
    assert scarce is not None and scarce.host_id == 1
    # as much H100-only demand as the H100's share of the GPUs: both models equally scarce, host order again
    even = {TaskShape(("7g.80gb",), models=frozenset({"A100-80GB"})): 8.0,
            TaskShape(("7g.80gb",), models=frozenset({"H100-80GB"})): 1.0}
    p = plan(req, hosts, get_policy("pack", even, {"H100-80GB": 1, "A100-80GB": 8}))
    assert p is not None and p.host_id == 0
    # the price is for room taken: a policy without pack's host cost ignores the supply
    assert where(req, hosts, "first-fit") == (0, 0)


@pytest.mark.parametrize(("profiles", "winner"), [(("T4-16C", "T4-8C"), 1), (("T4-8C", "T4-16C"), 0)])
def test_task_shape_takes_the_first_profile_a_gpu_offers(profiles: tuple[str, ...], winner: int) -> None:
    hosts = [host(0, occ(T4)), host(1, occ(T4, ("T4-8C", 0)))]
    # for 16C tasks an 8C on the empty T4 would strand its other half, on h1 it fills the stranded half;
    # for 8C tasks both are alike and the first host wins
    assert where(PlacementRequest(("T4-8C",), 1, 1024), hosts, "pack", {TaskShape(profiles): 1.0}) == (winner, 0)


def test_profile_mix_and_no_mix_still_pack_per_gpu() -> None:
    used = occ(A100, ("A100D-20C", 0))
    hosts = [host(0, occ(A100)), host(1, used)]
    req = PlacementRequest(("A100D-20C",), 1, 1024)
    assert where(req, hosts, "pack", {"A100D-20C": 3.0, "A100D-40C": 1.0}) == (1, 0)
    assert where(req, hosts, "pack") == (1, 0)
    assert where(req, hosts, "pack", {}) == (1, 0)
