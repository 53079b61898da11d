"""Stranded capacity by cause, on small fleets where each cause is known by hand."""

from __future__ import annotations

import pytest

from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.planning.demand import Ask, Demand
from vgpu_ctl.planning.fleet import Fleet, PlanGpu, PlanHost, carve
from vgpu_ctl.planning.whatif import make_plan

CATALOG = load_catalog()


def host(name: str, vcpus: float, gpus: list[tuple[str, str, str | None]]) -> PlanHost:
    return PlanHost(name, vcpus, 1 << 20, vcpus, 1 << 20,
                    tuple(PlanGpu(f"0000:{j:02x}:00.0", m, pool, carve(CATALOG, m, mode))
                          for j, (m, mode, pool) in enumerate(gpus)))


def demand(*asks: tuple[Ask, int]) -> Demand:
    shapes = tuple(a for a, _ in asks)
    counts = tuple(n for _, n in asks)
    return Demand(shapes, counts, tuple(i for i, n in enumerate(counts) for _ in range(n)))


def test_each_cause() -> None:
    fleet = Fleet((
        host("mig", 64, [("H100-80GB", "mig", "a")]),            # 7 x 1g.10gb leave slot 7: a MIG hole
        host("tight", 4, [("A100-80GB", "vgpu-equal", "b")]),    # 4 vCPUs: one 4-vCPU VM, then short
        host("pt", 64, [("A100-80GB", "passthrough", "b")]),     # passthrough: pool b asks only vGPUs
        host("idle", 64, [("L40S", "vgpu-mixed", "c")]),          # nobody asks for pool c
    ))
    d = demand((Ask("r0", ("1g.10gb",), pool="a", vcpus=1), 8),
               (Ask("r1", ("A100D-20C",), pool="b", vcpus=4), 2))
    result = make_plan(CATALOG, fleet, d, advise_hosts=False)
    o = result.outcome
    assert (o.placed, o.refused) == ([7, 1], [1, 1])
    s = result.stranded
    assert s["MIG holes"] == pytest.approx(1 / 8)
    assert s["hosts short of vCPUs or memory"] == pytest.approx(0.75)
    assert s["carving offers none of the demand"] == pytest.approx(1.0)
    assert s["nothing asked for"] == pytest.approx(1.0)
    assert s["usable"] == 0 and s["rounding to a profile"] == 0
    assert o.refusals[0].text == "1 GPU at the most vGPUs of that type they can hold"  # 7 x 1g at most
    assert "short of vCPUs" in o.refusals[1].text


def test_rounding_to_a_profile() -> None:
    fleet = Fleet((host("h", 64, [("A100-80GB", "vgpu-equal", None)]),))
    # 0.3 of a GPU rounds up to A100D-40C: half the GPU, the smallest type holding 30% (A100D-20C is 25%).
    result = make_plan(CATALOG, fleet, demand((Ask("r0", (), 0.3), 2)), advise_hosts=False)
    assert result.outcome.placed == [2]
    assert result.stranded["rounding to a profile"] == pytest.approx(2 * (0.5 - 0.3))
