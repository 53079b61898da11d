"""spread-load: spread weighing measured GPU load, handed in when the policy is made (the core does no I/O)."""

from __future__ import annotations

import pytest

from vgpu_ctl import load_catalog
from vgpu_ctl.core.geometry import Geometry, Occupancy, geometry_for
from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan
from vgpu_ctl.core.policies import POLICIES
from vgpu_ctl.core.policies.spread_load import check_loads, make_with_load

CATALOG = load_catalog()
A100 = geometry_for(CATALOG, "A100-80GB", "vgpu-equal")
REQ = PlacementRequest(("A100D-10C",), vcpus=2, memory_mib=4096)


def occ(g: Geometry, *placements: tuple[str, int]) -> Occupancy:
    o = Occupancy(g)
    for profile, start in placements:
        o = o.add(profile, start)
    return o


def hosts() -> list[HostView]:
    """GPU 1: one vGPU of eight, busy; GPU 2: three of eight, idle (on another host with the same headroom)."""
    busy = GpuView(1, "h0/0", occ(A100, ("A100D-10C", 0)))
    quiet = GpuView(2, "h1/0", occ(A100, ("A100D-10C", 0), ("A100D-10C", 10), ("A100D-10C", 20)))
    return [HostView(0, "h0", 64, 256 * 1024, (busy,), order=0), HostView(1, "h1", 64, 256 * 1024, (quiet,), order=1)]


def chosen(policy_name: str | None = None, load: dict[int, float] | None = None) -> int:
    policy = make_with_load(load or {}) if policy_name is None else get_policy(policy_name)
    p = plan(REQ, hosts(), policy)
    assert p is not None
    return p.devices[0].gpu_id


def test_plain_spread_takes_the_less_allocated_gpu_but_spread_load_takes_the_idle_one() -> None:
    assert chosen("spread") == 1  # fewer vGPUs allocated, though it is 90 % busy
    assert chosen(load={1: 0.9, 2: 0.01}) == 2


def test_without_loads_it_places_as_spread_and_is_registered_by_name() -> None:
    assert "spread-load" in POLICIES
    assert chosen("spread-load") == chosen("spread") == 1
    assert chosen(load={1: 0.02, 2: 0.03}) == 1  # loads in the same 5 % step: allocation decides


def test_a_gpu_without_a_measured_load_counts_as_idle() -> None:
    assert chosen(load={1: 0.5}) == 2


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.3"])
def test_a_bad_load_names_the_gpu(bad: object) -> None:
    with pytest.raises(ValueError, match="load of GPU 7 must be a ratio from 0 to 1"):
        check_loads({7: bad})  # type: ignore[dict-item]
