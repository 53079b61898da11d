"""Ranked placement candidates (the API's placements dry run): rank 1 is what `plan` chooses, every fitting host
is ranked by the policy's score, every other host says why not, and the Controller's view matches a dry run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serverfixtures import RunningServer, server  # noqa: F401  (the fixture, found by name)

from vgpu_ctl import Controller, InvalidInput, NotFound
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.core.geometry import Occupancy, geometry_for
from vgpu_ctl.core.placement import (
    GpuView,
    HostView,
    PlacementRequest,
    describe_refusal,
    get_policy,
    plan,
    rank_hosts,
)

CATALOG = load_catalog()
A100 = geometry_for(CATALOG, "A100-80GB", "vgpu-equal")
H100_MIG = geometry_for(CATALOG, "H100-80GB", "mig")
DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"


def _fleet(fills: list[list[int]], vcpus: list[int]) -> list[HostView]:
    hosts = []
    for i, (gpus, cpu) in enumerate(zip(fills, vcpus, strict=False)):
        views = []
        for j, n in enumerate(gpus):
            o = Occupancy(H100_MIG)
            for k in range(n):
                o = o.add("1g.10gb", o.geometry.shapes["1g.10gb"].starts[k])
            views.append(GpuView(10 * i + j, f"h{i}/{j}", o))
        hosts.append(HostView(i, f"h{i}", cpu, 512 * 1024, tuple(views), order=i))
    return hosts


@settings(max_examples=60, deadline=None)
@given(fills=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3), min_size=1, max_size=5),
       vcpus=st.lists(st.integers(0, 16), min_size=5, max_size=5),
       profile=st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]), count=st.integers(1, 2),
       policy=st.sampled_from(["pack", "spread", "first-fit", "best-fit"]))
def test_rank_one_is_the_plan_and_every_host_is_accounted_for(fills: list[list[int]], vcpus: list[int],
                                                               profile: str, count: int, policy: str) -> None:
    hosts = _fleet(fills, vcpus)
    req = PlacementRequest((profile,) * count, 4, 1024)
    pol = get_policy(policy)
    ranked = rank_hosts(req, hosts, pol)
    assert sorted(c.host for c in ranked) == sorted(h.name for h in hosts)
    fitting = [c for c in ranked if c.plan is not None]
    assert [c.rank for c in fitting] == list(range(1, len(fitting) + 1))
    assert [c.score for c in fitting] == sorted(c.score for c in fitting if c.score is not None)
    chosen = plan(req, hosts, pol)
    assert (chosen is None) == (not fitting)
    if chosen is not None:
        assert fitting[0].plan == chosen
    for c in ranked[len(fitting):]:
        host = next(h for h in hosts if h.name == c.host)
        assert c.rank is None and sum(c.refusal.values()) == len(host.gpus)


def test_a_host_that_does_not_fit_says_why_in_an_admins_words() -> None:
    full = Occupancy(A100).add("A100D-10C", 0)
    hosts = [HostView(0, "busy", 64, 1 << 20, (GpuView(0, "busy/0", full),)),
             HostView(1, "small", 1, 1 << 20, (GpuView(1, "small/0", Occupancy(A100)),)),
             HostView(2, "ok", 64, 1 << 20, (GpuView(2, "ok/0", Occupancy(A100)),))]
    ranked = rank_hosts(PlacementRequest(("A100D-40C",), 8, 1024), hosts, get_policy("pack"))
    assert [(c.host, c.rank) for c in ranked] == [("ok", 1), ("busy", None), ("small", None)]
    assert describe_refusal(ranked[1].refusal) == "1 GPU holding (or pinned to) another vGPU type"
    assert describe_refusal(ranked[2].refusal) == "1 GPU on a host short of vCPUs"


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.apply_inventory(DEMO)
    ctl.create_tenant("acme")
    ctl.create_tenant("globex")
    return ctl


def _dry(ctl: Controller, profile: str, count: int, **kw: Any) -> Any:
    return ctl.request_vm("acme", "x", [(profile, count)], vcpus=4, memory_mib=4096, dry_run=True, **kw)


@pytest.mark.parametrize(("profile", "count"), [("H100-1-10C", 1), ("A100D-40C", 2), ("L40S-12C", 1),
                                                ("3g.40gb", 1)])
def test_the_controllers_rank_one_is_where_a_dry_run_goes(acme: Controller, profile: str, count: int) -> None:
    acme.request_vm("acme", "first", [(profile, 1)], vcpus=4, memory_mib=4096, provision=False)
    ranked = acme.placement_candidates("acme", [(profile, count)], vcpus=4, memory_mib=4096)
    dry = _dry(acme, profile, count)
    best = ranked[0]
    assert best["rank"] == 1 and best["why_not"] is None
    assert (best["host"], best["pool"]) == (dry.host, dry.pool)
    assert [(d["gpu"], d["start"]) for d in best["devices"]] == [(d.gpu, d.start) for d in dry.devices]


def test_a_cordoned_host_is_listed_with_its_reason_and_nothing_changes(acme: Controller) -> None:
    acme.set_host_state("kvm-h100-01", "draining")
    before = acme.events(limit=1000)
    ranked = acme.placement_candidates("acme", [("H100-1-10C", 1)], vcpus=4, memory_mib=4096, pool="inference")
    h100 = next(r for r in ranked if r["host"] == "kvm-h100-01")
    assert h100["rank"] is None and "cordoned (draining) host" in h100["why_not"]
    assert acme.events(limit=1000) == before and acme.list_vms() == []


def test_bad_input_names_the_field_and_another_tenant_is_not_found(acme: Controller) -> None:
    with pytest.raises(InvalidInput, match="limit") as err:
        acme.placement_candidates("acme", [("H100-1-10C", 1)], vcpus=4, memory_mib=4096, limit=0)
    assert err.value.reasons[0]["field"] == "limit"
    with pytest.raises(InvalidInput, match="vcpus"):
        acme.placement_candidates("acme", [("H100-1-10C", 1)], vcpus=10**30, memory_mib=4096)
    token = acme.issue_token("globex")
    with Controller(acme.engine.url.render_as_string(hide_password=False), token=token,
                    state_path=acme.state_path) as globex, pytest.raises(NotFound, match="tenant 'acme'"):
        globex.placement_candidates("acme", [("H100-1-10C", 1)], vcpus=4, memory_mib=4096)


def test_candidates_over_http_rank_like_the_dry_run_and_hide_other_tenants(server: RunningServer) -> None:  # noqa: F811
    body = {"name": "x", "vgpus": [{"profile": "H100-1-10C", "count": 1}], "vcpus": 4, "memory_mib": 4096}
    auth = server.auth(server.tenant_token)
    ranked = httpx.post(f"{server.url}/v1/placements/candidates", json=body, headers=auth, timeout=30)
    dry = httpx.post(f"{server.url}/v1/placements", json=body, headers=auth, timeout=30)
    assert ranked.status_code == 200 and dry.status_code == 200, (ranked.text, dry.text)
    best = ranked.json()[0]
    assert best["rank"] == 1 and (best["host"], best["pool"]) == (dry.json()["host"], dry.json()["pool"])
    assert [d["gpu"] for d in best["devices"]] == [d["gpu"] for d in dry.json()["devices"]]
    other = httpx.post(f"{server.url}/v1/placements/candidates", json={**body, "tenant": "acme"},
                       headers=server.auth(server.other_token), timeout=30)
    assert other.status_code == 404 and other.json()["code"] == "not_found"
    bad = httpx.post(f"{server.url}/v1/placements/candidates", params={"limit": 0}, json=body, headers=auth,
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["reasons"][0]["field"] == "limit"
