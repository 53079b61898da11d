"""Tenant quotas on SQLite and PostgreSQL: global, per-pool and per-profile limits, framebuffer, 0 and
unlimited, refusal reasons, and usage that always equals the sum of what is allocated."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import assert_unchanged_but_refusal, check_store_invariants, store_snapshot

from vgpu_ctl import Controller, InvalidInput, NoCapacity, NotFound, QuotaExceeded, Refused


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def req(ctl: Controller, name: str, profile: str | list[tuple[str, int]], vcpus: int = 2, memory_mib: int = 4096,
        tenant: str = "acme", **kw: Any) -> Any:
    vgpus = [(profile, 1)] if isinstance(profile, str) else profile
    return ctl.request_vm(tenant, name, vgpus, vcpus=vcpus, memory_mib=memory_mib, **kw)


def usage(ctl: Controller, tenant: str = "acme") -> dict[tuple[str, str], tuple[int, int | None]]:
    return {(r["scope"], r["resource"]): (r["used"], r["limit"]) for r in ctl.tenant_usage(tenant)}


def refused(ctl: Controller, exc: type[Refused], *args: Any, **kw: Any) -> Refused:
    before = store_snapshot(ctl)
    with pytest.raises(exc) as err:
        req(ctl, *args, **kw)
    assert_unchanged_but_refusal(ctl, before)
    return err.value


def test_global_vm_limit(acme: Controller) -> None:
    acme.set_quota("acme", {"vms": 2})
    req(acme, "a", "A100D-10C")
    req(acme, "b", "1g.10gb")
    e = refused(acme, QuotaExceeded, "c", "A100D-10C")
    assert e.code == "quota_exceeded" and e.exit_code == 3
    assert e.reasons == [{"kind": "quota", "tenant": "acme", "scope": "*", "resource": "vms", "limit": 2,
                          "used": 2, "requested": 1}]
    assert "vms" in e.message and "limit 2" in e.message
    acme.release_vm("acme/a")
    req(acme, "c", "A100D-10C")
    assert usage(acme)[("*", "vms")] == (2, 2)
    check_store_invariants(acme.engine)


def test_quota_checked_before_dry_run_too(acme: Controller) -> None:
    acme.set_quota("acme", {"vgpus": 1})
    with pytest.raises(QuotaExceeded):
        req(acme, "a", [("1g.10gb", 2)], dry_run=True)
    assert req(acme, "a", "1g.10gb", dry_run=True).host == "kvm-h100-01"


def test_several_limits_reported_together(acme: Controller) -> None:
    acme.set_quota("acme", {"vcpus": 8, "memory_mib": 8192, "vgpus": 3})
    req(acme, "a", "A100D-10C", vcpus=6, memory_mib=6144)
    e = refused(acme, QuotaExceeded, "b", [("A100D-10C", 3)], vcpus=4, memory_mib=4096)
    got = {r["resource"]: (r["limit"], r["used"], r["requested"]) for r in e.reasons}
    assert got == {"vcpus": (8, 6, 4), "memory_mib": (8192, 6144, 4096), "vgpus": (3, 1, 3)}


def test_framebuffer_limit(acme: Controller) -> None:
    acme.set_quota("acme", {"framebuffer_mib": 30 * 1024})
    req(acme, "a", "A100D-20C", pool="training")
    e = refused(acme, QuotaExceeded, "b", "A100D-20C", pool="training")
    assert e.reasons[0] | {} == {"kind": "quota", "tenant": "acme", "scope": "*", "resource": "framebuffer_mib",
                                 "limit": 30720, "used": 20480, "requested": 20480}
    req(acme, "b", "A100D-10C", pool="inference")
    assert usage(acme)[("*", "framebuffer_mib")] == (30720, 30720)


def test_zero_allows_none_and_unlimited_clears(acme: Controller) -> None:
    acme.set_quota("acme", {"vms": 0})
    e = refused(acme, QuotaExceeded, "a", "A100D-10C")
    assert (e.reasons[0]["limit"], e.reasons[0]["used"]) == (0, 0)
    acme.set_quota("acme", {"vms": None})
    assert usage(acme)[("*", "vms")] == (0, None)
    req(acme, "a", "A100D-10C")
    acme.set_quota("acme", {"profile:A100D-10C": 0})
    refused(acme, QuotaExceeded, "b", "A100D-10C")
    acme.set_quota("acme", {"profile:A100D-10C": None})
    req(acme, "b", "A100D-10C")
    assert ("*", "profile:A100D-10C") in usage(acme)
    check_store_invariants(acme.engine)


def test_per_pool_limits(acme: Controller) -> None:
    acme.set_quota("acme", {"vms": 1, "vgpus": 2}, pool="inference")
    req(acme, "a", "1g.10gb", pool="inference")
    e = refused(acme, QuotaExceeded, "b", "1g.10gb", pool="inference")
    assert e.reasons == [{"kind": "quota", "tenant": "acme", "scope": "inference", "resource": "vms", "limit": 1,
                          "used": 1, "requested": 1}]
    assert "in pool inference" in e.message
    req(acme, "b", "1g.10gb", pool="training")  # other pools are not limited
    u = usage(acme)
    assert u[("inference", "vms")] == (1, 1) and u[("inference", "vgpus")] == (1, 2)
    assert u[("*", "vms")] == (2, None)
    check_store_invariants(acme.engine)


def test_pool_limit_does_not_block_other_pools(acme: Controller) -> None:
    acme.set_quota("acme", {"vms": 0}, pool="inference")
    vm = req(acme, "a", "1g.10gb")  # inference (first by name) is closed to acme, training offers 1g.10gb
    assert vm.pool == "training"


def test_profile_limits_global_and_per_pool(acme: Controller) -> None:
    acme.set_quota("acme", {"profile:1g.10gb": 3})
    acme.set_quota("acme", {"profile:1g.10gb": 1}, pool="training")
    req(acme, "a", "1g.10gb", pool="training")
    e = refused(acme, QuotaExceeded, "b", "1g.10gb", pool="training")
    assert [(r["scope"], r["resource"], r["limit"], r["used"], r["requested"]) for r in e.reasons] == \
        [("training", "profile:1g.10gb", 1, 1, 1)]
    req(acme, "b", [("1g.10gb", 2)], pool="inference")
    e = refused(acme, QuotaExceeded, "c", "1g.10gb", pool="inference")
    assert [(r["scope"], r["resource"], r["limit"], r["used"]) for r in e.reasons] == \
        [("*", "profile:1g.10gb", 3, 3)]
    req(acme, "c", "2g.20gb", pool="inference")  # another profile is not limited
    u = usage(acme)
    assert u[("*", "profile:1g.10gb")] == (3, 3) and u[("training", "profile:1g.10gb")] == (1, 1)
    check_store_invariants(acme.engine)


def test_limit_set_after_use_counts_existing_vms(acme: Controller) -> None:
    req(acme, "a", "1g.10gb", pool="inference")
    req(acme, "b", "1g.10gb", pool="inference")
    acme.set_quota("acme", {"profile:1g.10gb": 2, "vms": 1}, pool="inference")
    u = usage(acme)
    assert u[("inference", "profile:1g.10gb")] == (2, 2) and u[("inference", "vms")] == (2, 1)
    refused(acme, QuotaExceeded, "c", "1g.10gb", pool="inference")
    acme.release_vm("acme/a")
    acme.release_vm("acme/b")
    u = usage(acme)
    assert u[("inference", "profile:1g.10gb")] == (0, 2) and u[("inference", "vms")] == (0, 1)
    req(acme, "c", "1g.10gb", pool="inference")
    check_store_invariants(acme.engine)


def test_quota_refusal_wins_over_capacity(acme: Controller) -> None:
    acme.set_quota("acme", {"vcpus": 4})
    with pytest.raises(QuotaExceeded):
        req(acme, "a", "A100D-10C", vcpus=1000)
    acme.set_quota("acme", {"vcpus": None})
    with pytest.raises(NoCapacity):
        req(acme, "a", "A100D-10C", vcpus=1000)
    assert usage(acme)[("*", "vcpus")] == (0, None)


BAD_LIMITS: list[tuple[dict[str, Any], str | None, type[Exception], str, Any]] = [
    ({"vms": -1}, None, InvalidInput, "vms", -1),
    ({"vgpus": "3"}, None, InvalidInput, "vgpus", "3"),
    ({"vcpus": 1.5}, None, InvalidInput, "vcpus", 1.5),
    ({"gpus": 3}, None, InvalidInput, "resource", "gpus"),
    ({"profile:A100D-3C": 1}, None, InvalidInput, "profile", "A100D-3C"),
    ({"profile:1g.10gb": -2}, "inference", InvalidInput, "profile:1g.10gb", -2),
    ({"vms": 1}, "nowhere", NotFound, "pool", "nowhere"),
]


@pytest.mark.parametrize("limits,pool,exc,field,value", BAD_LIMITS,
                         ids=["negative", "string", "float", "unknown-resource", "unknown-profile",
                              "negative-in-pool", "unknown-pool"])
def test_bad_limits_change_nothing(acme: Controller, limits: dict[str, Any], pool: str | None,
                                   exc: type[Exception], field: str, value: Any) -> None:
    acme.set_quota("acme", {"vms": 5})
    before = store_snapshot(acme)
    with pytest.raises(exc) as err:
        acme.set_quota("acme", {"vgpus": 4, **limits}, pool=pool)  # a good limit first: it must not stick
    e: Any = err.value
    assert field in e.message and str(value) in e.message, e.message
    assert any(r.get("field") == field and r.get("value") == value for r in e.reasons), e.reasons
    assert store_snapshot(acme) == before


def test_quota_of_unknown_tenant(ctl: Controller) -> None:
    before = store_snapshot(ctl)
    with pytest.raises(NotFound, match="nobody"):
        ctl.set_quota("nobody", {"vms": 1})
    with pytest.raises(NotFound, match="nobody"):
        ctl.tenant_usage("nobody")
    assert store_snapshot(ctl) == before


def _independent_usage(ctl: Controller, tenant: str) -> dict[tuple[str, str], int]:
    sums = check_store_invariants(ctl.engine)[tenant]
    return {k: v for k, v in sums.items() if k[0] == "*"}


def test_usage_matches_allocations_after_mixed_creates_and_deletes(acme: Controller) -> None:
    ctl = acme
    ctl.create_tenant("beta")
    ctl.set_quota("acme", {"vms": 6, "profile:1g.10gb": 3})
    ctl.set_quota("beta", {"vgpus": 4}, pool="inference")
    rng = random.Random(7)
    choices = {"inference": ["A100D-10C", "1g.10gb", "2g.20gb", "3g.40gb", "H100-1-10C"],
               "training": ["A100D-20C", "A100D-40C", "A100-80GB", "1g.10gb", "H100-2-20C"],
               "workstations": ["L40S-8C", "L40S-12C", "L40S-24C", "L40S-4C"]}
    live: list[str] = []
    outcomes = {"ok": 0, "refused": 0, "deleted": 0}
    for i in range(40):
        if live and rng.random() < 0.35:
            ctl.release_vm(live.pop(rng.randrange(len(live))))
            outcomes["deleted"] += 1
        else:
            tenant = rng.choice(["acme", "beta"])
            pool = rng.choice(sorted(choices))
            vgpus = [(rng.choice(choices[pool]), 1) for _ in range(rng.choice([1, 1, 2]))]
            try:
                vm = req(ctl, f"vm{i}", vgpus, tenant=tenant, pool=pool, vcpus=rng.randint(1, 16),
                         memory_mib=rng.choice([1024, 4096, 65536]))
                live.append(vm.id)
                outcomes["ok"] += 1
            except Refused:
                outcomes["refused"] += 1
        for t in ("acme", "beta"):
            reported = {(r["scope"], r["resource"]): r["used"] for r in ctl.tenant_usage(t)}
            expected = _independent_usage(ctl, t)
            for key, n in reported.items():
                if key[0] == "*":
                    assert n == expected.get(key, 0), (t, key)
            for key, n in expected.items():
                assert reported.get(key, 0) == n, (t, key)
    assert outcomes["ok"] > 5 and outcomes["refused"] > 0 and outcomes["deleted"] > 3
    listed = {t["name"]: t for t in ctl.list_tenants()}
    for t in ("acme", "beta"):
        exp = _independent_usage(ctl, t)
        assert listed[t]["vms"] == exp.get(("*", "vms"), 0)
        assert listed[t]["vgpus"] == exp.get(("*", "vgpus"), 0)
        assert listed[t]["framebuffer_mib"] == exp.get(("*", "framebuffer_mib"), 0)
    for vm_id in live:
        ctl.release_vm(vm_id)
    for r in ctl.tenant_usage("acme") + ctl.tenant_usage("beta"):
        assert r["used"] == 0, r
    check_store_invariants(ctl.engine)
