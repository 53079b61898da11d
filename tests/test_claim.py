"""The claim (`vgpu_ctl.service.claim`), on SQLite and PostgreSQL: one path that plans from a read, then
charges and takes in a short conditional write. Uncontended requests land as planned and the store stays
consistent; a GPU, or an anti-affinity group, changed between the read and the write makes it plan again
without a double claim; refusals are explained, pool-scoped limits send a request to the next pool, a dry
run writes nothing; the results are typed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    assert_unchanged_but_refusal,
    check_store_invariants,
    libpq_trace,
    round_trips,
    store_snapshot,
    trace_messages,
)
from sqlalchemy import event, update

from vgpu_ctl import Conflict, Controller, InvalidInput, NoCapacity, Placement, QuotaExceeded, VmInfo
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service import claim
from vgpu_ctl.service.requests import VgpuRequest, VmRequest
from vgpu_ctl.store.engine import make_engine
from vgpu_ctl.store.tables import GPU, POOL


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


def plans(monkeypatch: pytest.MonkeyPatch, between: Callable[[Any], None] | None = None) -> list[Any]:
    """Record every plan the claim makes (None: nothing fit the page), and run `between(plan)` once, right
    after the first plan that fits: between the claim's read and its write."""
    original = claim.plan
    made: list[Any] = []

    def plan_then_change(*args: Any, **kw: Any) -> Any:
        chosen = original(*args, **kw)
        first = chosen is not None and all(p is None for p in made)
        made.append(chosen)
        if first and between is not None:
            between(chosen)
        return chosen

    monkeypatch.setattr(claim, "plan", plan_then_change)
    return made


def fitting(made: list[Any]) -> list[Any]:
    return [p for p in made if p is not None]


# -- typed results ---------------------------------------------------------------------------------------------


def test_claim_answers_with_typed_results(acme: Controller) -> None:
    ask = VmRequest("acme", "a", (VgpuRequest("A100D-10C", 1),), 2, 4096, idempotency_key="k-1")
    planned = claim.claim(acme, ask, dry_run=True)
    assert isinstance(planned, claim.Planned) and planned.placement.host == "kvm-a100-01"
    assert acme.list_vms() == []
    claimed = claim.claim(acme, ask)
    assert isinstance(claimed, claim.Claimed) and claimed.vm.state == "placed"
    assert [(d.gpu, d.start) for d in claimed.vm.devices] == \
        [(p.gpu, p.start) for p in planned.placement.devices]
    assert claimed.vm == acme.get_vm(claimed.vm.id)  # what the claim wrote, as the store now says
    assert claim.claim(acme, ask) == claim.AlreadyMade(claimed.vm.id)
    assert claim.claim(acme, ask, dry_run=True) == claim.AlreadyMade(claimed.vm.id)
    assert len(acme.list_vms()) == 1 and usage(acme)[("*", "vms")] == (1, None)


# -- uncontended ---------------------------------------------------------------------------------------------


def test_uncontended_requests_land_as_planned(acme: Controller, state_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = acme
    made = plans(monkeypatch)
    a = req(ctl, "a", "A100D-10C", vcpus=8, memory_mib=16384)
    assert isinstance(a, VmInfo) and (a.host, a.pool, a.state) == ("kvm-a100-01", "inference", "placed")
    assert [d.gpu for d in a.devices] == ["kvm-a100-01/0000:81:00.0"]
    b = req(ctl, "b", [("3g.40gb", 2)], pool="inference", vcpus=16)  # several GPUs (the hosts query)
    c = req(ctl, "c", "L40S-12C", labels={"zone": "b"})  # labels read with the candidates
    d = req(ctl, "d", "1g.10gb", provision=True)  # and provisioned on its host afterwards
    assert [p.host for p in fitting(made)] == [a.host, b.host, c.host, d.host]  # one plan each: no retry
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


def test_idempotency_key_answers_from_the_read(acme: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    first = req(acme, "a", "A100D-10C", idempotency_key="k-1")
    made = plans(monkeypatch)
    again = req(acme, "a", "A100D-10C", idempotency_key="k-1")
    assert again.id == first.id
    assert made == []  # the second found the key in its read: nothing planned
    assert len(acme.list_vms()) == 1 and usage(acme)[("*", "vms")] == (1, None)
    check_store_invariants(acme.engine)


def test_gpu_changed_after_the_read_makes_the_claim_retry(acme: Controller, store_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = acme
    other = make_engine(store_url)

    def bump(chosen: Any) -> None:
        with other.begin() as conn:
            conn.execute(update(GPU).where(GPU.c.id == chosen.devices[0].gpu_id).values(version=GPU.c.version + 1))

    made = plans(monkeypatch, bump)
    try:
        vm = req(ctl, "a", "3g.40gb", pool="inference")
    finally:
        other.dispose()
    first, second = fitting(made)  # planned twice: the first write found the GPU changed
    assert first.devices == second.devices and vm.devices[0].gpu_id == first.devices[0].gpu_id
    assert len(ctl.list_vms()) == 1 and usage(ctl)[("*", "vms")] == (1, None)  # the failed try charged nothing
    assert usage(ctl)[("*", "vgpus")] == (1, None)
    check_store_invariants(ctl.engine)


def test_competing_claim_after_the_read_never_double_claims(acme: Controller, store_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = acme
    ctl.create_tenant("rival")
    rival = Controller(store_url, init=False)
    taken: list[Any] = []

    def claim_the_same_space(chosen: Any) -> None:
        taken.append(req(rival, "r", "A100D-10C", tenant="rival"))

    made = plans(monkeypatch, claim_the_same_space)
    try:
        vm = req(ctl, "a", "A100D-10C")  # only the pinned GPU takes A100D-10C: the rival plans the same start
    finally:
        rival.close()
    [r] = taken
    mine, theirs, again = fitting(made)
    assert mine.devices == theirs.devices and again.devices != mine.devices  # planned again after losing
    assert (vm.devices[0].gpu, r.devices[0].gpu) == ("kvm-a100-01/0000:81:00.0",) * 2
    assert {vm.devices[0].start, r.devices[0].start} == {0, 10}
    assert usage(ctl)[("*", "vms")] == (1, None) and usage(ctl, "rival")[("*", "vms")] == (1, None)
    check_store_invariants(ctl.engine)


def test_name_conflict_changes_nothing(acme: Controller) -> None:
    req(acme, "a", "A100D-10C")
    before = store_snapshot(acme)
    with pytest.raises(Conflict, match="already has a VM named 'a'"):
        req(acme, "a", "1g.10gb")
    assert store_snapshot(acme) == before


def test_name_conflict_with_an_idempotency_key(acme: Controller) -> None:
    req(acme, "a", "A100D-10C", idempotency_key="k-1")
    with pytest.raises(Conflict, match="already has a VM named 'a'"):
        req(acme, "a", "A100D-10C", idempotency_key="k-2")


# -- refusals, pools, groups, dry runs ---------------------------------------------------------------------------


def test_over_a_tenant_limit_is_explained_and_charges_nothing(acme: Controller) -> None:
    ctl = acme
    ctl.set_quota("acme", {"vms": 1})
    req(ctl, "a", "A100D-10C")
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "b", "A100D-10C")
    assert err.value.reasons == [{"kind": "quota", "tenant": "acme", "scope": "*", "resource": "vms", "limit": 1,
                                  "used": 1, "requested": 1}]
    assert "vms" in err.value.message and "limit 1" in err.value.message
    assert_unchanged_but_refusal(ctl, before)

    ctl.set_quota("acme", {"vms": None, "vcpus": 8, "memory_mib": 8192, "vgpus": 3})
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "b", [("A100D-10C", 3)], vcpus=8, memory_mib=8192)
    got = {r["resource"]: (r["scope"], r["limit"], r["used"], r["requested"]) for r in err.value.reasons}
    assert got == {"vcpus": ("*", 8, 2, 8), "memory_mib": ("*", 8192, 4096, 8192), "vgpus": ("*", 3, 1, 3)}
    assert_unchanged_but_refusal(ctl, before)
    check_store_invariants(ctl.engine)


def test_over_a_tenant_limit_wins_over_no_capacity(acme: Controller) -> None:
    acme.set_quota("acme", {"vcpus": 4})
    before = store_snapshot(acme)
    with pytest.raises(QuotaExceeded) as err:
        req(acme, "x", "A100D-10C", vcpus=500)  # fits nowhere either: the limit is what the tenant can change
    assert [r["resource"] for r in err.value.reasons] == ["vcpus"]
    assert_unchanged_but_refusal(acme, before)


def test_no_capacity_is_explained_per_pool(acme: Controller) -> None:
    before = store_snapshot(acme)
    with pytest.raises(NoCapacity) as err:
        req(acme, "x", "A100D-10C", vcpus=500)
    assert {r["pool"] for r in err.value.reasons} == {"inference", "training"}
    for r in err.value.reasons:
        assert r["kind"] == "capacity" and r["gpus"] > 0 and r["counts"] == {"vcpus": r["gpus"]}
    assert_unchanged_but_refusal(acme, before)


def test_named_pool_that_does_not_offer_the_profile_is_invalid_input(acme: Controller) -> None:
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match="profile 'L40S-12C' is not offered by pool 'training'") as err:
        req(acme, "x", "L40S-12C", pool="training")
    assert err.value.reasons == [{"field": "profile", "value": "L40S-12C"}]
    assert store_snapshot(acme) == before


def test_pool_limit_in_the_first_pool_lands_in_the_next(acme: Controller) -> None:
    ctl = acme
    ctl.set_quota("acme", {"vms": 0}, pool="inference")  # inference is first by name and offers 1g.10gb
    vm = req(ctl, "a", "1g.10gb")
    assert vm.pool == "training" and vm.devices[0].gpu == "kvm-h100-01/0000:4c:00.0"
    u = usage(ctl)
    assert u[("inference", "vms")] == (0, 0) and u[("*", "vms")] == (1, None)
    check_store_invariants(ctl.engine)

    ctl.set_quota("acme", {"vgpus": 3}, pool="training")  # a pool-scoped limit with room left is charged
    assert usage(ctl)[("training", "vgpus")] == (1, 3)
    req(ctl, "b", "2g.20gb", pool="training")  # the fixed layout's 1g.10gb slot is taken
    assert usage(ctl)[("training", "vgpus")] == (2, 3)
    check_store_invariants(ctl.engine)

    ctl.set_quota("acme", {"vms": 0}, pool="training")  # now both pools are closed by their own limits
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "c", "1g.10gb")
    assert [(r["scope"], r["resource"]) for r in err.value.reasons] == [("inference", "vms"), ("training", "vms")]
    assert_unchanged_but_refusal(ctl, before)


def test_anti_affinity_keeps_a_group_apart(acme: Controller) -> None:
    a = req(acme, "a", "1g.10gb", anti_affinity="db")
    c = req(acme, "c", "A100D-20C", anti_affinity="db")
    assert c.host != a.host == "kvm-h100-01"
    with pytest.raises(NoCapacity):
        req(acme, "b", "1g.10gb", anti_affinity="db")  # only one host offers MIG 1g.10gb
    b = req(acme, "b", "1g.10gb", anti_affinity="web")
    assert b.host == a.host
    check_store_invariants(acme.engine)


def test_group_placed_after_the_read_makes_the_claim_plan_again(acme: Controller, store_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rival = Controller(store_url, init=False)
    taken: list[Any] = []

    def place_the_group_there(chosen: Any) -> None:  # another GPU of the same host, the same group
        taken.append(req(rival, "r", "1g.10gb", pool="training", anti_affinity="db"))

    made = plans(monkeypatch, place_the_group_there)
    try:
        with pytest.raises(NoCapacity):  # planned again without that host: no other host offers MIG
            req(acme, "a", "1g.10gb", pool="inference", anti_affinity="db")
    finally:
        rival.close()
    [r] = taken
    mine = fitting(made)[0]
    assert r.host == mine.host == "kvm-h100-01" and r.devices[0].gpu_id != mine.devices[0].gpu_id
    assert [v.name for v in acme.list_vms()] == ["r"] and usage(acme)[("*", "vms")] == (1, None)
    check_store_invariants(acme.engine)


def test_dry_run_never_writes(acme: Controller, state_dir: Path) -> None:
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
    assert SimulatedHost("kvm-h100-01", state_dir / "hosts").list_devices() == []
    vm = req(ctl, "x", "3g.40gb")
    assert (vm.devices[0].gpu, vm.devices[0].start) == (plan.devices[0].gpu, plan.devices[0].start)
    check_store_invariants(ctl.engine)


@pytest.mark.postgres
def test_on_postgres_a_claim_is_six_round_trips_its_write_two_in_the_reads_read_committed_transaction(
        pg_acme: Controller, tmp_path: Path) -> None:
    from sqlalchemy import event

    ctl = pg_acme
    req(ctl, "warm", "A100D-10C")  # statements compiled, pool connection made

    @event.listens_for(ctl.engine, "checkout")
    def isolation(dbapi: Any, _record: Any, _proxy: Any) -> None:  # before the trace starts
        assert dbapi.execute("SHOW transaction_isolation").fetchone()[0] == "read committed"
        dbapi.rollback()

    with libpq_trace(ctl.engine, tmp_path / "trace.txt"):
        req(ctl, "a", "A100D-10C")
    event.remove(ctl.engine, "checkout", isolation)
    messages = trace_messages(tmp_path / "trace.txt")
    assert not any('"ROLLBACK"' in m for m in messages)  # no ROLLBACK and BEGIN between the read and the write
    write = next(i for i, m in enumerate(messages) if '"UPDATE tenant' in m)
    # BEGIN; the tenant, pools and whether any priority class; the pools' offers of the profile; the host
    # pages of the profile's two placeables (the demo's A100s in equal- and mixed-size mode), each together
    assert round_trips(messages[:write]) == 4
    assert round_trips(messages[write:]) == 2  # every write of the claim together, then COMMIT
    generic = next(i for i, m in enumerate(messages) if "force_generic_plan" in m)  # sent with the pages, first
    assert any('"SELECT gpu.id' in m for m in messages[generic:write])
    assert [v.state for v in ctl.list_vms("acme") if v.name == "a"] == ["placed"]
    check_store_invariants(ctl.engine)


def test_a_name_taken_while_over_quota_is_refused_for_the_quota(acme: Controller) -> None:
    # The claim's writes are sent together, the VM's INSERT beside the charge: the limit is still the answer.
    ctl = acme
    req(ctl, "a", "A100D-10C")
    ctl.set_quota("acme", {"vms": 1})
    before = store_snapshot(ctl)
    with pytest.raises(QuotaExceeded) as err:
        req(ctl, "a", "A100D-10C")
    assert err.value.reasons[0]["resource"] == "vms"
    assert_unchanged_but_refusal(ctl, before)
    ctl.set_quota("acme", {"vms": None})
    with pytest.raises(Conflict, match="already has a VM named 'a'"):
        req(ctl, "a", "A100D-10C")


@pytest.fixture
def two_controllers(store_url: str, acme: Controller) -> Iterator[tuple[Controller, Controller]]:
    second = Controller(store_url, init=False)
    try:
        yield acme, second
    finally:
        second.close()


def test_two_controllers_alternate_on_one_store(two_controllers: tuple[Controller, Controller]) -> None:
    one, two = two_controllers
    vms = [req(c, f"v{i}", "A100D-10C", pool="inference") for i, c in enumerate([one, two] * 4)]
    assert sorted(v.devices[0].start for v in vms) == list(range(0, 80, 10))
    assert all(isinstance(v, VmInfo) for v in vms)
    with pytest.raises(NoCapacity):
        req(two, "full", "A100D-10C", pool="inference")
    check_store_invariants(one.engine)



def rival_after_each_plan(monkeypatch: pytest.MonkeyPatch,
                          rival_ctl: Controller) -> tuple[list[threading.Thread], list[VmInfo]]:
    """After each plan this thread's claim makes, a rival (tenant `rival`, through `rival_ctl`) claims the same
    slot on a thread of its own, waited for 2 s; the rivals' threads and the VMs they took."""
    original = claim.plan
    me = threading.get_ident()
    rivals: list[threading.Thread] = []
    taken: list[VmInfo] = []

    def plan_then_rival(*args: Any, **kw: Any) -> Any:
        chosen = original(*args, **kw)
        if chosen is not None and threading.get_ident() == me:
            name = f"r{len(rivals)}"
            t = threading.Thread(target=lambda: taken.append(req(rival_ctl, name, "A100D-10C", tenant="rival",
                                                                 pool="inference")))
            rivals.append(t)
            t.start()
            t.join(timeout=2)  # done at once, unless it waits for this claim's turn
        return chosen

    monkeypatch.setattr(claim, "plan", plan_then_rival)
    return rivals, taken


def test_a_claim_that_keeps_losing_races_to_another_replica_claims_in_its_turn(
        two_controllers: tuple[Controller, Controller], monkeypatch: pytest.MonkeyPatch) -> None:
    """As below, with the rival on another Controller of the store (its own pool, its own process-wide locks:
    another replica). On PostgreSQL the turn of one process's threads does not hold another's, so the claim
    also holds the store's claim turn (an advisory lock, every claim's write taking it beside the others): it
    lands on try CONTENDED_AFTER + 1. Before, it lost every race, 30 of them, and gave up."""
    ctl, replica = two_controllers
    ctl.create_tenant("rival")
    rivals, taken = rival_after_each_plan(monkeypatch, replica)
    vm = req(ctl, "a", "A100D-10C", pool="inference")
    for t in rivals:
        t.join()
    assert len(rivals) == claim.CONTENDED_AFTER + 1 and len(taken) == len(rivals)
    starts = [v.devices[0].start for v in [vm, *taken]]
    assert sorted(starts) == list(range(0, 10 * len(starts), 10))
    assert usage(ctl)[("*", "vms")] == (1, None) and usage(ctl, "rival")[("*", "vms")] == (len(taken), None)
    check_store_invariants(ctl.engine)


@pytest.mark.parametrize("policy", ["pack", "spread-load"])  # spread-load reads GPU loads on a side connection
def test_a_claim_that_keeps_losing_races_claims_in_its_turn(acme: Controller, monkeypatch: pytest.MonkeyPatch,
                                                            policy: str) -> None:
    """A rival thread takes the claim's slot after each of its reads. The claim wins no race until, after
    CONTENDED_AFTER of them, it reads, plans and writes in its turn: the rival's write then waits for it."""
    ctl = acme
    ctl.create_tenant("rival")
    with ctl.engine.begin() as conn:
        conn.execute(update(POOL).where(POOL.c.name == "inference").values(policy=policy))
    me = threading.get_ident()
    turns = ctl.ctx.claim_turn
    held: list[int] = []  # connections out of the pool whenever this thread asks for the turn
    in_turn = [0]
    checkouts_in_turn: list[int] = []  # connections this thread took from the pool while it held the turn

    @contextmanager
    def turn_after_the_connection() -> Iterator[None]:
        mine = threading.get_ident() == me
        if mine:
            held.append(ctl.engine.pool.checkedout())  # type: ignore[attr-defined]
        with turns():
            in_turn[0] += mine
            try:
                yield
            finally:
                in_turn[0] -= mine

    @event.listens_for(ctl.engine, "checkout")
    def _checkout(*_: Any) -> None:
        if threading.get_ident() == me and in_turn[0]:
            checkouts_in_turn.append(in_turn[0])

    rivals, taken = rival_after_each_plan(monkeypatch, ctl)
    monkeypatch.setattr(ctl.ctx, "claim_turn", turn_after_the_connection)
    vm = req(ctl, "a", "A100D-10C", pool="inference")  # only its pinned GPU takes A100D-10C: the rival plans
    for t in rivals:
        t.join()
    assert len(rivals) == claim.CONTENDED_AFTER + 1 and len(taken) == len(rivals)
    # Asked for after the connection, as by every write: the other order deadlocks when the pool runs out. The
    # contended try holds its one connection when it asks, and asks for no other (spread-load's GPU loads too).
    assert len(held) == len(rivals) + 1 and min(held) >= 1 and held[claim.CONTENDED_AFTER] == 1
    assert checkouts_in_turn == []
    starts = [v.devices[0].start for v in [vm, *taken]]
    assert sorted(starts) == list(range(0, 10 * len(starts), 10))
    assert usage(ctl)[("*", "vms")] == (1, None) and usage(ctl, "rival")[("*", "vms")] == (len(taken), None)
    check_store_invariants(ctl.engine)
