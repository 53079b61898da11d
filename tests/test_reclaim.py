"""Reclaim (issue 13, section 4, Kueue's reclaimWithinCohort): a request of a tenant below its guarantee that does
not fit takes back what other tenants borrow above theirs, whatever its priority, through the preemption
machinery (victims by geometry, requeue or cancel, grace, audit with reason 'reclaim', the cool-down, the metric);
never a VM within its tenant's guarantee, never for a request that would itself borrow, and only when sharing
gets strictly fairer. Whether a VM is borrowed follows its tenant's usage as it stands (a release can make newer
work guaranteed), and a reclaim never takes a lender below its guarantee. Then the invariants after random
claims, releases and reclaims (hypothesis)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, assert_unchanged_but_refusal, check_store_invariants, store_snapshot
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from vgpu_ctl import Controller, NoCapacity
from vgpu_ctl.core.preemption import borrowed_share, strictly_improves
from vgpu_ctl.errors import QuotaExceeded
from vgpu_ctl.service import scheduling

SLICE = "A100D-10C"  # the demo's inference pool has one A100 pinned to it: 8 of these


def small(ctl: Controller, tenant: str, name: str, **kw: Any) -> Any:
    return ctl.request_vm(tenant, name, [(SLICE, 1)], vcpus=1, memory_mib=1024, pool="inference", **kw)


def flags(ctl: Controller) -> dict[str, bool]:
    """Whether each VM ("tenant/name") is borrowed now."""
    now, names = borrowed_now(ctl)
    return {f"{t}/{name}": vm_id in now for vm_id, (t, name) in names.items()}


def borrowed_now(ctl: Controller) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """The ids of the VMs borrowed now, and every VM's (tenant, name) by id."""
    with ctl.engine.connect() as conn:
        rows = conn.execute(text("SELECT v.id, v.name, v.tenant_id, t.name AS tenant FROM vm v "
                                 "JOIN tenant t ON t.id = v.tenant_id")).all()
        return scheduling.borrowed_vms(conn, {r.tenant_id for r in rows}), {r.id: (r.tenant, r.name) for r in rows}


def vgpus_used(ctl: Controller, tenant: str) -> int:
    return int(next(r["used"] for r in ctl.tenant_usage(tenant) if r["resource"] == "vgpus" and r["scope"] == "*"))


def admission_order(ctl: Controller) -> list[str]:
    """The ids of the VMs that hold quota, oldest admission first."""
    with ctl.engine.connect() as conn:
        return [r[0] for r in conn.execute(text("SELECT s.vm_id FROM vm_sched s JOIN vm v ON v.id = s.vm_id "
                                                "ORDER BY s.admitted_at, s.vm_id"))]


def lender_fills_the_gpu(ctl: Controller) -> None:
    """acme (guarantee 4, burst 8) takes all 8 slots: 4 guaranteed, 4 borrowed; beta has a guarantee of 4."""
    for t in ("acme", "beta"):
        ctl.create_tenant(t)
        ctl.set_quota(t, {"vgpus": 8}, guarantees={"vgpus": 4})
    for i in range(8):
        small(ctl, "acme", f"a{i}")


def test_reclaim_requeues_a_borrowed_vm_and_the_reclaimer_runs(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    ctl.scheduling.create_class("prod", 1000)  # the borrowed VMs are of a high, non-preemptible class
    got = small(ctl, "beta", "b0")  # beta has no class: priority 0, below every VM it takes back
    assert got.state == "running"
    names = {v.name for v in ctl.list_vms()}
    assert names == {f"a{i}" for i in range(7)} | {"b0"}  # the newest borrowed VM went
    queue = ctl.scheduling.queue()
    assert [(q["tenant"], q["name"], q["requeued"]) for q in queue] == [("acme", "a7", True)]
    events = ctl.events()
    pre = next(e for e in events if e["action"] == "vm.preempt")
    assert pre["params"]["reason"] == "reclaim" and [v["name"] for v in pre["params"]["victims"]] == ["a7"]
    assert next(e for e in events if e["action"] == "vm.preempted")["params"]["reason"] == "reclaim"
    assert ctl.scheduling.preemption_counts() == {("reclaim", "requeue"): 1}
    assert flags(ctl)["beta/b0"] is False
    check_store_invariants(ctl.engine)


def test_a_dry_run_shows_the_reclaim_and_changes_nothing(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    before = store_snapshot(ctl)
    plan = ctl.scheduling.preview("beta", "b0", [(SLICE, 1)], vcpus=1, memory_mib=1024, pool="inference")
    assert plan.reason == "reclaim" and [(v.tenant, v.name) for v in plan.victims] == [("acme", "a7")]
    assert store_snapshot(ctl) == before


def test_reclaim_up_to_the_guarantee_and_never_the_lenders_guaranteed_vms(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    guaranteed = {v.id for v in ctl.list_vms() if not flags(ctl)[f"acme/{v.name}"]}
    assert len(guaranteed) == 4
    for i in range(4):
        small(ctl, "beta", f"b{i}")
    assert {v.id for v in ctl.list_vms("acme")} == guaranteed
    assert sorted(q["name"] for q in ctl.scheduling.queue()) == ["a4", "a5", "a6", "a7"]
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity):  # a 5th would be borrowed: it may not reclaim (and acme borrows nothing now)
        small(ctl, "beta", "b4")
    after = store_snapshot(ctl)
    assert after["vms"] == before["vms"] and after["devices"] == before["devices"]
    assert {v.id for v in ctl.list_vms("acme")} == guaranteed
    # beta releases: acme's requeued VMs come back, borrowed again (acme is above its guarantee again)
    ctl.release_vm("beta/b0")
    back = [v.name for v in ctl.list_vms("acme") if v.id not in guaranteed]
    assert len(back) == 1 and flags(ctl)[f"acme/{back[0]}"] is True
    check_store_invariants(ctl.engine)


def test_no_reclaim_when_asked_not_to_preempt_or_without_a_guarantee(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    ctl.create_tenant("gamma")  # no guarantee: nothing to reclaim for
    ctl.set_quota("gamma", {"vgpus": 8})
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity):
        small(ctl, "gamma", "g0")
    with pytest.raises(NoCapacity):
        small(ctl, "beta", "b0", preempt=False)
    after = store_snapshot(ctl)
    assert after["vms"] == before["vms"] and after["devices"] == before["devices"]
    assert ctl.scheduling.preemption_counts() == {}


def test_a_queued_request_within_its_guarantee_reclaims_when_admitted(ctl: Controller) -> None:
    for t in ("acme", "beta"):
        ctl.create_tenant(t)
    ctl.set_quota("acme", {"vgpus": 8}, guarantees={"vgpus": 0})
    for i in range(8):
        small(ctl, "acme", f"a{i}")  # every one borrowed: acme's guarantee is 0
    op = small(ctl, "beta", "b0", queue=True)  # no guarantee yet: it waits
    assert op.state == "pending"
    ctl.set_quota("beta", {"vgpus": 2}, guarantees={"vgpus": 2})
    assert len(ctl.scheduling.admit()) == 1
    assert ctl.get_vm("beta/b0").state == "running"
    assert ctl.scheduling.preemption_counts() == {("reclaim", "requeue"): 1}
    check_store_invariants(ctl.engine)


def test_the_cool_down_protects_a_readmitted_victim_from_an_equal_reclaim(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    small(ctl, "beta", "b0")  # reclaims a7
    ctl.release_vm("beta/b0")  # a7 comes back, borrowed, protected from priority-0 reclaims for the cool-down
    assert ctl.get_vm("acme/a7").state == "running"
    victim_before = small(ctl, "beta", "b1")  # takes the next newest borrowed VM, not a7
    assert victim_before.state == "running"
    assert ctl.get_vm("acme/a7").state == "running"
    assert "a6" in [q["name"] for q in ctl.scheduling.queue()]


def test_a_release_makes_newer_work_guaranteed_and_no_lender_goes_below_its_guarantee(ctl: Controller) -> None:
    for t, g in (("acme", 4), ("beta", 4), ("gamma", None)):
        ctl.create_tenant(t)
        ctl.set_quota(t, {"vgpus": 8}, guarantees={"vgpus": g} if g is not None else None)
    for i in range(6):
        small(ctl, "acme", f"a{i}")  # a4 and a5 past the guarantee of 4
    small(ctl, "gamma", "g0")
    small(ctl, "gamma", "g1")  # the GPU is full
    assert sorted(k for k, v in flags(ctl).items() if v) == ["acme/a4", "acme/a5"]
    ctl.release_vm("acme/a0")
    small(ctl, "gamma", "g2")  # full again
    assert [k for k, v in flags(ctl).items() if v] == ["acme/a5"]  # a4 is within the guarantee now
    # beta (within its guarantee) needs two slots: taking a4 and a5 would leave acme at 3 of its 4 guaranteed
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity, match="reclaiming does not help"):
        ctl.request_vm("beta", "two", [(SLICE, 2)], vcpus=1, memory_mib=1024, pool="inference")
    assert_unchanged_but_refusal(ctl, before)
    small(ctl, "beta", "one")  # one slot: a5 comes back, acme stays at its guarantee
    assert sorted(v.name for v in ctl.list_vms() if v.tenant == "acme") == ["a1", "a2", "a3", "a4"]
    assert vgpus_used(ctl, "acme") == 4
    check_store_invariants(ctl.engine)


def test_a_vm_borrowed_by_one_resource_stays_when_taking_it_breaks_another_guarantee(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 8, "memory_mib": 65536}, guarantees={"vgpus": 4, "memory_mib": 4096})
    for t, g in (("beta", 4), ("gamma", None)):
        ctl.create_tenant(t)
        ctl.set_quota(t, {"vgpus": 8}, guarantees={"vgpus": g} if g is not None else None)
    for i in range(4):
        ctl.request_vm("acme", f"a{i}", [(SLICE, 1)], vcpus=1, memory_mib=512, pool="inference")
    ctl.request_vm("acme", "big", [(SLICE, 1)], vcpus=1, memory_mib=2048, pool="inference")  # 5 > 4 vGPUs
    for i in range(3):
        small(ctl, "gamma", f"g{i}")  # the GPU is full
    assert [k for k, v in flags(ctl).items() if v] == ["acme/big"]
    # taking big back would leave acme at 2048 MiB of its 4096 guaranteed: no reclaim
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity, match="reclaiming does not help"):
        small(ctl, "beta", "b0")
    assert_unchanged_but_refusal(ctl, before)


def test_fair_share_check() -> None:
    assert borrowed_share({"vgpus": 6}, {"vgpus": 4}) == 0.5
    assert borrowed_share({"vgpus": 3}, {"vgpus": 4}) == 0.0
    assert borrowed_share({"vgpus": 2}, {"vgpus": 0}) == 2.0
    assert borrowed_share({"vgpus": 9}, {}) == 0.0
    assert strictly_improves({"lender": 1.0, "reclaimer": 0.0}, {"lender": 0.75, "reclaimer": 0.0})
    assert not strictly_improves({"a": 0.5, "b": 0.0}, {"a": 0.0, "b": 0.5})  # a swap: a loop, refused
    assert not strictly_improves({"a": 0.5}, {"a": 0.5})


def test_reclaim_over_quota_is_a_quota_refusal(ctl: Controller) -> None:
    lender_fills_the_gpu(ctl)
    ctl.set_quota("beta", {"vgpus": 0}, guarantees={"vgpus": 0})
    with pytest.raises(QuotaExceeded):  # a quota refusal is never solved by taking others' VMs
        small(ctl, "beta", "b0")
    assert ctl.scheduling.preemption_counts() == {}


# -- property: random claims, releases and reclaims ---------------------------------------------------------------

TENANTS = {"acme": (2, 6), "beta": (3, 5), "gamma": (None, 8)}  # guarantee, burst (vGPUs)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(["claim", "claim", "release"]), st.sampled_from(sorted(TENANTS)),
                          st.integers(0, 7)), min_size=1, max_size=18))
def test_invariants_after_random_claims_releases_and_reclaims(ops: list[tuple[str, str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        import os
        os.environ["VGPU_CTL_STATE_DIR"] = tmp
        with Controller(f"sqlite:///{Path(tmp) / 'store.db'}") as ctl:
            ctl.apply_inventory(DEMO)
            for t, (g, burst) in TENANTS.items():
                ctl.create_tenant(t)
                ctl.set_quota(t, {"vgpus": burst}, guarantees={"vgpus": g} if g is not None else None)
            n = 0
            # a full GPU to start from: acme at its burst (4 of its 6 borrowed), gamma with the last 2 slots
            prelude = [("claim", "acme", 0)] * 6 + [("claim", "gamma", 0)] * 2
            for op, tenant, k in prelude + ops:
                before_ids, _ = borrowed_now(ctl)
                used_before = {t: vgpus_used(ctl, t) for t in TENANTS}
                seen = len(ctl.events())
                if op == "claim":
                    n += 1
                    with contextlib.suppress(NoCapacity, QuotaExceeded):
                        small(ctl, tenant, f"v{n}")
                else:
                    vms = ctl.list_vms()
                    if vms:
                        ctl.release_vm(vms[k % len(vms)].id)
                check_store_invariants(ctl.engine)
                # borrowed follows usage as it stands: per tenant, exactly its usage above the guarantee, its
                # newest VMs (admission order), however they came and whatever was released before them
                now_ids, names = borrowed_now(ctl)
                for t, (g, _burst) in TENANTS.items():
                    mine = [i for i in admission_order(ctl) if names[i][0] == t]
                    over = max(0, len(mine) - g) if g is not None else 0
                    assert {i for i in mine if i in now_ids} == set(mine[len(mine) - over:]), (t, mine)
                for e in ctl.events()[seen:]:
                    if e["action"] != "vm.preempt":
                        continue
                    event("reclaimed")
                    assert e["params"]["reason"] == "reclaim"
                    lost: dict[str, int] = {}
                    for v in e["params"]["victims"]:
                        assert v["vm_id"] in before_ids, v  # only work borrowed at that moment is taken back
                        lost[v["tenant"]] = lost.get(v["tenant"], 0) + 1
                    for t, k_lost in lost.items():  # and no lender falls below its guarantee
                        g = TENANTS[t][0]
                        assert g is not None and used_before[t] - k_lost >= min(used_before[t], g), (t, lost)
