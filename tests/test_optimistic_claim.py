"""The claim's fast path (`Controller._claim_optimistic`: plan from a read, then a short conditional write),
on SQLite and PostgreSQL: used when nothing contends and the store stays consistent; a GPU changed between the
read and the write makes it retry without a double claim; refusals, pool-scoped limits that send a request to
another pool, anti-affinity and dry runs take the serialized path and behave as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, assert_unchanged_but_refusal, check_store_invariants, store_snapshot
from sqlalchemy import update

from vgpu_ctl import Conflict, Controller, NoCapacity, Placement, QuotaExceeded, VmInfo
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service.allocation import GPU, ClaimConflict
from vgpu_ctl.store.engine import make_engine


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def req(ctl: Controller, name: str, profile: str | list[tuple[str, int]], vcpus: int = 2, memory_mib: int = 4096,
        tenant: str = "acme", provision: bool = False, **kw: Any) -> Any:
    vgpus = [(profile, 1)] if isinstance(profile, str) else profile
    return ctl.request_vm(tenant, name, vgpus, vcpus=vcpus, memory_mib=memory_mib, provision=provision, **kw)


def usage(ctl: Controller, tenant: str = "acme") -> dict[tuple[str, str], tuple[int, int | None]]:
    return {(r["scope"], r["resource"]): (r["used"], r["limit"]) for r in ctl.tenant_usage(tenant)}


Calls = list[tuple[Controller, Any]]


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> Calls:
    """Record each call of Controller.`name`: (controller, what it returned or raised)."""
    original: Callable[..., Any] = getattr(Controller, name)
    calls: Calls = []

    def wrapper(self: Controller, *args: Any, **kw: Any) -> Any:
        try:
            result = original(self, *args, **kw)
        except BaseException as exc:
            calls.append((self, exc))
            raise
        calls.append((self, result))
        return result

    monkeypatch.setattr(Controller, name, wrapper)
    return calls


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return spy(monkeypatch, "_claim_optimistic")


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return spy(monkeypatch, "_claim_in")


def outcomes(calls: Calls, ctl: Controller) -> list[Any]:
    return [r for c, r in calls if c is ctl]


# -- the fast path ---------------------------------------------------------------------------------------------


def test_uncontended_requests_take_the_fast_path(acme: Controller, fast: Calls, slow: Calls,
                                                  state_dir: Path) -> None:
    ctl = acme
    a = req(ctl, "a", "A100D-10C", vcpus=8, memory_mib=16384)
    assert isinstance(a, VmInfo) and (a.host, a.pool, a.state) == ("kvm-a100-01", "inference", "placed")
    assert [d.gpu for d in a.devices] == ["kvm-a100-01/0000:81:00.0"]
    b = req(ctl, "b", [("3g.40gb", 2)], pool="inference", vcpus=16)  # several GPUs (the hosts query)
    c = req(ctl, "c", "L40S-12C", labels={"zone": "b"})  # labels read with the candidates
    d = req(ctl, "d", "1g.10gb", provision=True)  # and provisioned on its host afterwards
    out = outcomes(fast, ctl)
    assert out[:3] == [a, b, c] and len(out) == 4 and isinstance(out[3], VmInfo) and out[3].id == d.id
    assert slow == []
    assert len({x.gpu for x in b.devices}) == 2 and b.host == "kvm-h100-01"
    assert c.host == "kvm-l40s-01"
    assert d.state == "running" and d.simulated
    assert [x.uuid for x in SimulatedHost("kvm-h100-01", state_dir / "hosts").list_devices()] == \
        [x.uuid for x in d.devices]
    assert usage(ctl)[("*", "vms")] == (4, None) and usage(ctl)[("*", "vgpus")] == (5, None)
    assert {v.name: v.id for v in ctl.list_vms("acme")} == {"a": a.id, "b": b.id, "c": c.id, "d": d.id}
    events = [e for e in ctl.events("acme") if e["action"] == "vm.create"]
    assert len(events) == 4 and all(e["result"] == "ok" for e in events)
    check_store_invariants(ctl.engine)
    for vm in (a, b, c, d):
        ctl.release_vm(vm.id)
    check_store_invariants(ctl.engine)
    assert usage(ctl)[("*", "vms")] == (0, None)


def test_idempotency_key_on_the_fast_path(acme: Controller, fast: Calls, slow: Calls) -> None:
    first = req(acme, "a", "A100D-10C", idempotency_key="k-1")
    again = req(acme, "a", "A100D-10C", idempotency_key="k-1")
    assert again.id == first.id
    assert outcomes(fast, acme) == [first, first.id]  # the second found the key in its read
    assert slow == []
    assert len(acme.list_vms()) == 1 and usage(acme)[("*", "vms")] == (1, None)
    check_store_invariants(acme.engine)


def _plan_hook(monkeypatch: pytest.MonkeyPatch, between: Callable[[Any], None]) -> list[int]:
    """Run `between(chosen plan)` once, right after the first successful plan: between the fast path's read
    and its write. Returns the GPU ids the hook ran for."""
    original = Controller._plan_in_pool
    done: list[int] = []

    def plan_then_change(self: Controller, *args: Any, **kw: Any) -> Any:
        chosen, page = original(self, *args, **kw)
        if chosen is not None and not done:
            done.append(chosen.devices[0].gpu_id)
            between(chosen)
        return chosen, page

    monkeypatch.setattr(Controller, "_plan_in_pool", plan_then_change)
    return done


def test_gpu_changed_after_the_read_makes_the_claim_retry(acme: Controller, store_url: str, fast: Calls,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = acme
    other = make_engine(store_url)

    def bump(chosen: Any) -> None:
        with other.begin() as conn:
            conn.execute(update(GPU).where(GPU.c.id == chosen.devices[0].gpu_id).values(version=GPU.c.version + 1))

    done = _plan_hook(monkeypatch, bump)
    try:
        vm = req(ctl, "a", "3g.40gb", pool="inference")
    finally:
        other.dispose()
    assert len(done) == 1
    first, second = outcomes(fast, ctl)
    assert isinstance(first, ClaimConflict) and isinstance(second, VmInfo) and second.id == vm.id
    assert len(ctl.list_vms()) == 1 and usage(ctl)[("*", "vms")] == (1, None)  # the failed try charged nothing
    assert usage(ctl)[("*", "vgpus")] == (1, None)
    check_store_invariants(ctl.engine)


def test_competing_claim_after_the_read_never_double_claims(acme: Controller, store_url: str, fast: Calls,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = acme
    ctl.create_tenant("rival")
    rival = Controller(store_url, init=False)
    taken: list[Any] = []

    def claim_the_same_space(chosen: Any) -> None:
        taken.append(req(rival, "r", "A100D-10C", tenant="rival"))

    done = _plan_hook(monkeypatch, claim_the_same_space)
    try:
        vm = req(ctl, "a", "A100D-10C")  # only the pinned GPU takes A100D-10C: the rival plans the same start
    finally:
        rival.close()
    [r] = taken
    assert len(done) == 1
    mine = outcomes(fast, ctl)
    assert isinstance(mine[0], ClaimConflict) and mine[-1] == vm, mine
    assert (vm.devices[0].gpu, r.devices[0].gpu) == ("kvm-a100-01/0000:81:00.0",) * 2
    assert {vm.devices[0].start, r.devices[0].start} == {0, 10}
    assert usage(ctl)[("*", "vms")] == (1, None) and usage(ctl, "rival")[("*", "vms")] == (1, None)
    check_store_invariants(ctl.engine)


def test_name_conflict_on_the_fast_path(acme: Controller, fast: Calls) -> None:
    req(acme, "a", "A100D-10C")
    before = store_snapshot(acme)
    with pytest.raises(Conflict, match="already has a VM named 'a'"):
        req(acme, "a", "1g.10gb")
    assert isinstance(outcomes(fast, acme)[-1], Exception)  # the unique name stopped the write
    assert store_snapshot(acme) == before


def test_name_conflict_with_an_idempotency_key(acme: Controller) -> None:
    req(acme, "a", "A100D-10C", idempotency_key="k-1")
    with pytest.raises(Conflict, match="already has a VM named 'a'"):
        req(acme, "a", "A100D-10C", idempotency_key="k-2")


# -- what takes the serialized path -----------------------------------------------------------------------------


def test_over_a_tenant_limit_falls_back_and_charges_nothing(acme: Controller, fast: Calls, slow: Calls) -> None:
    ctl = acme
    ctl.set_quota("acme", {"vms": 1})
    req(ctl, "a", "A100D-10C")
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "b", "A100D-10C")
    assert err.value.reasons == [{"kind": "quota", "tenant": "acme", "scope": "*", "resource": "vms", "limit": 1,
                                  "used": 1, "requested": 1}]
    assert "vms" in err.value.message and "limit 1" in err.value.message
    assert outcomes(fast, ctl)[-1] is None and len(slow) == 1 and isinstance(slow[0][1], QuotaExceeded)
    assert_unchanged_but_refusal(ctl, before)

    ctl.set_quota("acme", {"vms": None, "vcpus": 8, "memory_mib": 8192, "vgpus": 3})
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "b", [("A100D-10C", 3)], vcpus=8, memory_mib=8192)
    got = {r["resource"]: (r["scope"], r["limit"], r["used"], r["requested"]) for r in err.value.reasons}
    assert got == {"vcpus": ("*", 8, 2, 8), "memory_mib": ("*", 8192, 4096, 8192), "vgpus": ("*", 3, 1, 3)}
    assert outcomes(fast, ctl)[-1] is None
    assert_unchanged_but_refusal(ctl, before)
    check_store_invariants(ctl.engine)


def test_no_capacity_falls_back_and_explains(acme: Controller, fast: Calls, slow: Calls) -> None:
    before = store_snapshot(acme)
    with pytest.raises(NoCapacity) as err:
        req(acme, "x", "A100D-10C", vcpus=500)
    assert {r["pool"] for r in err.value.reasons} == {"inference", "training"}
    for r in err.value.reasons:
        assert r["kind"] == "capacity" and r["gpus"] > 0 and r["counts"] == {"vcpus": r["gpus"]}
    assert outcomes(fast, acme) == [None] and len(slow) == 1
    assert_unchanged_but_refusal(acme, before)


def test_pool_limit_in_the_first_pool_lands_in_the_next(acme: Controller, fast: Calls, slow: Calls) -> None:
    ctl = acme
    ctl.set_quota("acme", {"vms": 0}, pool="inference")  # inference is first by name and offers 1g.10gb
    vm = req(ctl, "a", "1g.10gb")
    assert vm.pool == "training" and vm.devices[0].gpu == "kvm-h100-01/0000:4c:00.0"
    assert outcomes(fast, ctl) == [None] and outcomes(slow, ctl) == [vm]
    u = usage(ctl)
    assert u[("inference", "vms")] == (0, 0) and u[("*", "vms")] == (1, None)
    check_store_invariants(ctl.engine)

    # a pool-scoped limit with room left is charged on the fast path
    ctl.set_quota("acme", {"vgpus": 3}, pool="training")
    assert usage(ctl)[("training", "vgpus")] == (1, 3)
    b = req(ctl, "b", "2g.20gb", pool="training")  # the fixed layout's 1g.10gb slot is taken
    assert outcomes(fast, ctl)[-1] == b and len(slow) == 1
    assert usage(ctl)[("training", "vgpus")] == (2, 3)
    check_store_invariants(ctl.engine)


def test_anti_affinity_never_takes_the_fast_path(acme: Controller, fast: Calls, slow: Calls) -> None:
    a = req(acme, "a", "1g.10gb", anti_affinity="db")
    c = req(acme, "c", "A100D-20C", anti_affinity="db")
    assert c.host != a.host == "kvm-h100-01"
    with pytest.raises(NoCapacity):
        req(acme, "b", "1g.10gb", anti_affinity="db")  # only one host offers MIG 1g.10gb
    assert fast == [] and len(slow) == 3
    b = req(acme, "b", "1g.10gb", anti_affinity="web")
    assert b.host == a.host and fast == [] and len(slow) == 4
    d = req(acme, "d", "1g.10gb")  # without a group: the fast path again
    assert outcomes(fast, acme) == [d] and len(slow) == 4
    check_store_invariants(acme.engine)


def test_dry_run_never_writes(acme: Controller, fast: Calls, slow: Calls, state_dir: Path) -> None:
    ctl = acme
    req(ctl, "keep", "3g.40gb")
    before = store_snapshot(ctl)
    plan = req(ctl, "x", "3g.40gb", dry_run=True)
    assert isinstance(plan, Placement) and plan.host == "kvm-h100-01"
    ctl.set_quota("acme", {"vms": 1})
    quota_before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded):
        req(ctl, "y", "3g.40gb", dry_run=True)
    assert store_snapshot(ctl) == quota_before  # a refused dry run is not even audited
    ctl.set_quota("acme", {"vms": None})

    def unchanged(snapshot: dict[str, Any]) -> dict[str, Any]:  # the quota was set and cleared: a new generation
        return {k: [{c: x for c, x in r.items() if c != "generation"} for r in v] if k == "tenants" else v
                for k, v in snapshot.items() if k != "events"}
    assert unchanged(store_snapshot(ctl)) == unchanged(before)
    assert len(outcomes(fast, ctl)) == 1 and len(slow) == 2  # only "keep" took the fast path
    assert SimulatedHost("kvm-h100-01", state_dir / "hosts").list_devices() == []
    vm = req(ctl, "x", "3g.40gb")
    assert (vm.devices[0].gpu, vm.devices[0].start) == (plan.devices[0].gpu, plan.devices[0].start)
    check_store_invariants(ctl.engine)


@pytest.mark.postgres
def test_write_runs_in_a_new_transaction_after_the_read(pg_url: str, state_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = Controller(pg_url)
    try:
        ctl.apply_inventory(DEMO)
        ctl.create_tenant("acme")
        started: dict[str, Any] = {}

        def xact_start(conn: Any) -> Any:
            return conn.connection.driver_connection.execute("SELECT transaction_timestamp()").fetchone()[0]

        plan, commit = Controller._plan_in_pool, Controller._commit_claim

        def planned(self: Controller, conn: Any, *args: Any) -> Any:
            started.setdefault("read", xact_start(conn))
            time.sleep(0.05)
            return plan(self, conn, *args)

        def committed(self: Controller, conn: Any, *args: Any) -> Any:
            started.setdefault("write", xact_start(conn))
            return commit(self, conn, *args)

        monkeypatch.setattr(Controller, "_plan_in_pool", planned)
        monkeypatch.setattr(Controller, "_commit_claim", committed)
        req(ctl, "a", "A100D-10C")
        assert started["write"] > started["read"]
    finally:
        ctl.close()


@pytest.fixture
def two_controllers(store_url: str, acme: Controller) -> Iterator[tuple[Controller, Controller]]:
    second = Controller(store_url, init=False)
    try:
        yield acme, second
    finally:
        second.close()


def test_two_controllers_alternate_on_one_store(two_controllers: tuple[Controller, Controller],
                                                fast: Calls) -> None:
    one, two = two_controllers
    vms = [req(c, f"v{i}", "A100D-10C", pool="inference") for i, c in enumerate([one, two] * 4)]
    assert sorted(v.devices[0].start for v in vms) == list(range(0, 80, 10))
    assert all(isinstance(r, VmInfo) for _, r in fast) and len(fast) == 8
    with pytest.raises(NoCapacity):
        req(two, "full", "A100D-10C", pool="inference")
    check_store_invariants(one.engine)
