"""The server's in-memory allocator (`vgpu_ctl.service.allocator`), on SQLite and PostgreSQL: claims planned
in memory and written by group commit land as the store path would place them and keep the store consistent;
many callers at once never double-claim and quotas stay exact, also from two replicas (two allocators) on one
PostgreSQL store; a claim that loses a race against another writer reloads what changed and plans again."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, check_store_invariants, libpq_trace, round_trips, trace_messages, write_inventory
from test_host_summaries import NARROW_FIRST

from vgpu_ctl import Controller, NoCapacity, QuotaExceeded, VmInfo
from vgpu_ctl.errors import Conflict, InvalidInput
from vgpu_ctl.server.config import ServerConfig, load_config
from vgpu_ctl.server.runtime import Runtime
from vgpu_ctl.service.allocator import Allocator
from vgpu_ctl.service.principals import Principal


def served(ctl: Controller) -> Allocator:
    """Give the Controller's context an allocator, as `vgpuctl serve` does."""
    ctl.ctx.allocator = Allocator(ctl.ctx)
    return ctl.ctx.allocator


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def req(ctl: Controller, name: str, profile: str, tenant: str = "acme", **kw: Any) -> Any:
    return ctl.request_vm(tenant, name, [(profile, 1)], vcpus=2, memory_mib=4096, provision=False, **kw)


def usage(ctl: Controller, tenant: str = "acme") -> dict[tuple[str, str], int]:
    return {(r["scope"], r["resource"]): r["used"] for r in ctl.tenant_usage(tenant)}


def storm(ctls: list[Controller], profile: str, n: int, prefix: str = "s", **kw: Any) -> dict[str, list[Any]]:
    """`n` requests at once from a thread each, spread over the controllers, for VMs named `prefix`0, ...;
    what each got, by kind."""
    out: dict[str, list[Any]] = {"placed": [], "refused": [], "other": []}
    lock = threading.Lock()
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        try:
            got: Any = req(ctls[i % len(ctls)], f"{prefix}{i}", profile, **kw)
            kind = "placed"
        except (NoCapacity, QuotaExceeded) as exc:
            got, kind = exc, "refused"
        except Exception as exc:  # reported by the assertions on "other"
            got, kind = exc, "other"
        with lock:
            out[kind].append(got)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def positions(vms: list[VmInfo]) -> list[tuple[str, int]]:
    return sorted((d.gpu, d.start) for v in vms for d in v.devices)


def test_claims_through_memory_land_as_the_store_path_places_them(acme: Controller, store_url: str) -> None:
    store_path = Controller(store_url, init=False)
    try:
        store_path.create_tenant("other")
        expected = [req(store_path, f"e{i}", p, tenant="other", dry_run=True)
                    for i, p in enumerate(["A100D-10C", "3g.40gb", "L40S-12C"])]
    finally:
        store_path.close()
    allocator = served(acme)
    vms = [req(acme, f"v{i}", p) for i, p in enumerate(["A100D-10C", "3g.40gb", "L40S-12C"])]
    assert [(v.host, v.pool, [(d.gpu, d.start) for d in v.devices]) for v in vms] == \
        [(e.host, e.pool, [(d.gpu, d.start) for d in e.devices]) for e in expected]
    assert allocator.stats["claims"] == 3 and allocator.stats["store_path"] == 0
    assert [v.id for v in vms] == [acme.get_vm(v.id).id for v in vms] and all(v.state == "placed" for v in vms)
    assert usage(acme)[("*", "vms")] == 3
    events = [e for e in acme.events("acme") if e["action"] == "vm.create"]
    assert [e["result"] for e in events] == ["ok"] * 3
    check_store_invariants(acme.engine)
    acme.release_vm(vms[0].id)
    assert usage(acme)[("*", "vms")] == 2
    check_store_invariants(acme.engine)


@pytest.mark.parametrize("policy", ["pack", "best-fit", "first-fit", "spread"])
def test_memory_ranks_hosts_as_the_store_pages_them(state_dir: Path, store_url: str, tmp_path: Path,
                                                    policy: str) -> None:
    """Nine 2-GPU hosts before an 8-GPU host in host order: whole-host pages in memory list hosts in the store's
    order (for pack the widest first, then the fullest), so each claim of one or two GPUs lands where the store
    path (a dry run) plans it; pack ranked by the hosts' fullest GPU had only 2-GPU hosts on its first page."""
    c = Controller(store_url)
    try:
        c.apply_inventory(write_inventory(tmp_path, NARROW_FIRST.replace("policy: pack", f"policy: {policy}")))
        c.create_tenant("acme")
        allocator = served(c)
        for i, n in enumerate([1, 2, 1, 1, 2, 1, 2, 2, 1, 1]):
            ask: dict[str, Any] = {"vgpus": [("L40S-48C", n)], "vcpus": 2, "memory_mib": 2048, "pool": "wide",
                                   "provision": False}
            want = c.request_vm("acme", f"w{i}", dry_run=True, **ask)
            got = c.request_vm("acme", f"w{i}", **ask)
            assert (got.host, sorted(d.gpu for d in got.devices)) == (want.host, sorted(d.gpu for d in want.devices))
        assert allocator.stats["store_path"] == 10  # the dry runs alone
        assert c.get_vm("acme/w0").host == "kvm-09" or policy != "pack"
        check_store_invariants(c.engine)
    finally:
        c.close()


def test_reload_reads_again_only_the_hosts_that_changed(acme: Controller, store_url: str) -> None:
    """A reload keeps the views of hosts nothing changed (and their plans) and replaces those another writer
    changed, so memory then plans around the other writer's claim."""
    allocator = served(acme)
    other = Controller(store_url, init=False)
    try:
        before = {name: dict(p.hosts) for name, p in allocator._pools.items()}
        theirs = req(other, "theirs", "A100D-10C")
        allocator.reload()
        changed = {p.hosts[h].name for n, p in allocator._pools.items() for h in p.hosts
                   if p.hosts[h] is not before[n].get(h)}
        assert changed == {theirs.host}
        mine = req(acme, "mine", "A100D-10C")
        assert (mine.devices[0].gpu, mine.devices[0].start) != (theirs.devices[0].gpu, theirs.devices[0].start)
        assert allocator.stats["store_path"] == 0 and allocator.stats["lost"] == 0
        check_store_invariants(acme.engine)
    finally:
        other.close()


def test_what_memory_cannot_decide_goes_the_store_path(acme: Controller) -> None:
    allocator = served(acme)
    req(acme, "a", "A100D-10C")
    with pytest.raises(Conflict, match="already has a VM named 'a'"):  # the unique name, found in the write
        req(acme, "a", "A100D-10C")
    plan = req(acme, "x", "A100D-10C", dry_run=True)
    assert not isinstance(plan, VmInfo) and acme.list_vms() == [acme.get_vm("acme/a")]
    acme.set_quota("acme", {"vms": 1})
    with pytest.raises(QuotaExceeded) as err:
        req(acme, "b", "A100D-10C")
    assert err.value.reasons[0]["resource"] == "vms"
    assert allocator.stats["store_path"] == 3 and allocator.stats["claims"] == 1
    check_store_invariants(acme.engine)


def test_concurrent_callers_never_double_claim_and_quotas_stay_exact(acme: Controller) -> None:
    served(acme)
    got = storm([acme], "A100D-10C", 14, pool="inference")  # the pinned GPU holds 8
    assert got["other"] == [] and len(got["placed"]) == 8 and len(got["refused"]) == 6
    assert positions(got["placed"]) == [("kvm-a100-01/0000:81:00.0", s) for s in range(0, 80, 10)]
    assert usage(acme)[("*", "vms")] == 8
    check_store_invariants(acme.engine)

    acme.create_tenant("beta")
    acme.set_quota("beta", {"vgpus": 5})
    got = storm([acme], "1g.10gb", 12, tenant="beta")
    assert got["other"] == [] and len(got["placed"]) == 5
    assert all(isinstance(e, QuotaExceeded) for e in got["refused"])
    assert usage(acme, "beta")[("*", "vgpus")] == 5 and len(acme.list_vms("beta")) == 5
    check_store_invariants(acme.engine)


@pytest.mark.parametrize("path", ["store", "allocator"])
def test_more_callers_than_pooled_connections_each_get_an_answer(acme: Controller, path: str) -> None:
    """40 callers at once, more than the pool's 15 connections, all for the 8 slots of one GPU: each is placed
    or refused for capacity. None waits out the pool's timeout (a write that held the writer turn while it
    asked for a connection, with the connections held by claims waiting for the turn) or gives up racing."""
    if path == "allocator":
        served(acme)
    got = storm([acme], "A100D-10C", 40, pool="inference")
    assert got["other"] == [] and len(got["placed"]) == 8 and len(got["refused"]) == 32
    assert usage(acme)[("*", "vms")] == 8
    check_store_invariants(acme.engine)


def held_storm(ctl: Controller, allocator: Allocator, n: int, profile: str, **kw: Any) -> dict[str, list[Any]]:
    """A storm of `n` whose claims the committer finds queued together: it holds the first batch until the
    other callers have planned and queued theirs, so they are written as one batch."""
    gate = threading.Event()
    commit = allocator._commit
    holding: list[int] = []

    def held(batch: Any) -> None:
        holding.append(len(batch))
        gate.wait(30)
        commit(batch)

    allocator._commit = held  # type: ignore[method-assign]
    out: dict[str, list[Any]] = {}
    storming = threading.Thread(target=lambda: out.update(storm([ctl], profile, n, **kw)))
    storming.start()
    for _ in range(3000):
        if sum(holding) + allocator._queue.qsize() >= n:  # every claim held or queued
            break
        threading.Event().wait(0.01)
    gate.set()
    storming.join()
    allocator._commit = commit  # type: ignore[method-assign]
    return out


def test_a_claim_planned_on_one_that_loses_is_not_written_on_its_versions(acme: Controller, store_url: str) -> None:
    """Claim b is planned on a, still unsettled in memory, so b expects a's versions plus one. Another writer (a
    release on another controller) moves the GPU on by one meanwhile, so a loses; b's expected version is then
    the store's, for a state b never saw. b must be lost and planned again, not written: before, it landed, and
    the GPU's layout showed the released VM and a with no device (seen with two replicas on PostgreSQL)."""
    other = Controller(store_url, init=False)
    try:
        x = req(other, "x", "A100D-10C", pool="inference")  # start 0 of the pool's one GPU
        allocator = served(acme)
        gate, holding = threading.Event(), []
        commit = allocator._commit

        def held(batch: Any) -> None:
            holding.append([i.req.name for i in batch])
            if len(holding) == 1:
                gate.wait(30)
            commit(batch)

        allocator._commit = held  # type: ignore[method-assign]
        got: dict[str, Any] = {}
        callers = [threading.Thread(target=lambda n=n: got.update({n: req(acme, n, "A100D-10C", pool="inference")}))
                   for n in ("a", "b")]
        callers[0].start()
        for _ in range(3000):
            if holding:
                break
            threading.Event().wait(0.01)
        callers[1].start()
        for _ in range(3000):
            if allocator._queue.qsize():  # b planned on a, queued behind a's held batch
                break
            threading.Event().wait(0.01)
        other.release_vm(x.id)  # the GPU moves on by one: a's expected version is gone, b's is the store's
        gate.set()
        for t in callers:
            t.join(30)
        allocator._commit = commit  # type: ignore[method-assign]
        assert set(got) == {"a", "b"} and all(isinstance(v, VmInfo) for v in got.values())
        assert sorted(v.devices[0].start for v in got.values()) == [0, 10]
        assert usage(acme)[("*", "vms")] == 2
        check_store_invariants(acme.engine)  # the GPU's layout is its devices'
    finally:
        other.close()


def test_a_batch_is_written_as_one_and_a_loser_in_it_fails_alone(acme: Controller) -> None:
    allocator = served(acme)
    got = held_storm(acme, allocator, 6, "1g.10gb")
    assert got["other"] == got["refused"] == [] and len(got["placed"]) == 6
    assert allocator.stats["batches"] <= 2 and allocator.stats["split"] == 0  # the first claim(s), then the rest
    assert len(set(positions(got["placed"]))) == 6 and usage(acme)[("*", "vms")] == 6
    check_store_invariants(acme.engine)

    acme.set_quota("acme", {"vms": 9})  # 3 more: the batch of 5 as a whole would pass the limit
    got = held_storm(acme, allocator, 6, "1g.10gb", prefix="t")
    assert got["other"] == [] and len(got["placed"]) == 3
    assert all(isinstance(e, QuotaExceeded) for e in got["refused"]) and len(got["refused"]) == 3
    assert allocator.stats["split"] >= 1 and usage(acme)[("*", "vms")] == 9 and len(acme.list_vms("acme")) == 9
    check_store_invariants(acme.engine)


def _batch_round_trips(ctl: Controller, allocator: Allocator, n: int, trace_to: Path) -> list[int]:
    """A held storm of `n` (`held_storm`), the committer's connections traced with libpq: the round trips of each
    transaction it wrote (from its BEGIN to its COMMIT, the pool's pre-ping before the trace not counted)."""
    committing = threading.local()
    commit = allocator._commit

    def traced_commit(batch: Any) -> None:
        committing.on = True
        try:
            commit(batch)
        finally:
            committing.on = False

    allocator._commit = traced_commit  # type: ignore[method-assign]
    try:
        with libpq_trace(ctl.engine, trace_to, when=lambda: getattr(committing, "on", False)):
            got = held_storm(ctl, allocator, n, "1g.10gb", prefix=f"b{n}-")
    finally:
        allocator._commit = commit  # type: ignore[method-assign]
    assert got["other"] == got["refused"] == [] and len(got["placed"]) == n
    counts, start = [], 0
    messages = trace_messages(trace_to)
    for at, m in enumerate(messages):
        if m.startswith("B") and "ReadyForQuery\t I" in m:  # idle: the transaction ended
            counts.append(round_trips(messages[start:at + 1]))
            start = at + 1
    return counts


@pytest.mark.postgres
def test_on_postgres_a_batch_is_written_in_round_trips_that_do_not_grow_with_it(
        pg_acme: Controller, tmp_path: Path) -> None:
    ctl = pg_acme
    allocator = served(ctl)
    req(ctl, "warm", "1g.10gb")  # statements compiled, the pool's connections made
    small = _batch_round_trips(ctl, allocator, 2, tmp_path / "two.txt")
    large = _batch_round_trips(ctl, allocator, 7, tmp_path / "seven.txt")
    assert allocator.stats["split"] == 0
    # BEGIN, whether any priority class, every write of the batch together, COMMIT: however many claims
    assert max(small) == max(large) == 4, (small, large)
    check_store_invariants(ctl.engine)


def test_plans_on_a_gpu_that_do_not_follow_each_other_go_claim_by_claim(acme: Controller) -> None:
    allocator = served(acme)
    gate, holding = threading.Event(), threading.Event()
    commit = allocator._commit

    def held(batch: Any) -> None:
        holding.set()
        gate.wait(30)
        commit(batch)

    allocator._commit = held  # type: ignore[method-assign]
    got: dict[str, Any] = {}

    def claim(name: str) -> threading.Thread:
        t = threading.Thread(target=lambda: got.update({name: req(acme, name, "A100D-10C", pool="inference")}))
        t.start()
        return t

    def queued(n: int) -> None:
        for _ in range(3000):
            if allocator._queue.qsize() >= n:
                return
            threading.Event().wait(0.01)

    first = claim("c")  # the committer takes it and waits at the gate
    assert holding.wait(30)
    a = claim("a")
    queued(1)
    pool = allocator._pools["inference"]
    host = next(h.host_id for h in pool.hosts.values() if h.name == "kvm-a100-01")
    allocator._reload_hosts(pool, [host])  # memory as the store holds it: without c's and a's plans
    b = claim("b")  # plans where a did, expecting the same GPU version
    queued(2)
    gate.set()
    for t in (first, a, b):
        t.join()
    allocator._commit = commit  # type: ignore[method-assign]
    vms = [got[n] for n in "cab"]
    assert all(isinstance(v, VmInfo) for v in vms) and len(set(positions(vms))) == 3
    assert allocator.stats["lost"] >= 1 and allocator.stats["split"] >= 1
    check_store_invariants(acme.engine)


@pytest.fixture
def two_replicas(pg_url: str, state_dir: Any) -> Iterator[tuple[Controller, Controller]]:
    one = Controller(pg_url)
    one.apply_inventory(DEMO)
    one.create_tenant("acme")
    two = Controller(pg_url, init=False)
    try:
        served(one), served(two)
        yield one, two
    finally:
        two.close()
        one.close()


@pytest.mark.postgres
def test_two_replicas_on_postgresql_never_double_claim(two_replicas: tuple[Controller, Controller]) -> None:
    one, two = two_replicas
    got = storm([one, two], "A100D-10C", 14, pool="inference")
    assert got["other"] == [] and len(got["placed"]) == 8 and len(got["refused"]) == 6
    assert positions(got["placed"]) == [("kvm-a100-01/0000:81:00.0", s) for s in range(0, 80, 10)]
    one.set_quota("acme", {"vms": 11})
    got = storm([one, two], "1g.10gb", 8, prefix="t")  # names the first storm may have placed would conflict
    assert got["other"] == [] and len(got["placed"]) == 3
    assert usage(one)[("*", "vms")] == 11 and len(one.list_vms("acme")) == 11
    assert one.ctx.allocator is not None and two.ctx.allocator is not None
    assert one.ctx.allocator.stats["lost"] + two.ctx.allocator.stats["lost"] > 0  # the replicas did race
    check_store_invariants(one.engine)


def test_a_claim_that_loses_a_race_reloads_and_plans_again(acme: Controller, store_url: str) -> None:
    allocator = served(acme)  # memory read now: the pinned GPU's first start is free
    rival = Controller(store_url, init=False)
    try:
        rival.create_tenant("rival")
        taken = [req(rival, f"r{i}", "A100D-10C", tenant="rival") for i in range(2)]  # behind the allocator's back
    finally:
        rival.close()
    vm = req(acme, "a", "A100D-10C")
    assert [t.devices[0].start for t in taken] == [0, 10] and vm.devices[0].start == 20
    assert allocator.stats["lost"] == 1 and allocator.stats["claims"] == 1 and allocator.stats["store_path"] == 0
    assert usage(acme)[("*", "vms")] == 1
    check_store_invariants(acme.engine)


# -- in `vgpuctl serve` ---------------------------------------------------------------------------------------


def test_serve_claims_through_its_allocator_unless_told_not_to(tmp_path: Path, state_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    with Controller(url) as admin:
        admin.apply_inventory(DEMO)
        admin.create_tenant("acme")
    for enabled in (True, False):
        rt = Runtime(ServerConfig(store=url, reconcile_interval_s=0, allocator=enabled))
        try:
            vm = req(rt.controller(Principal("admin")), f"v-{str(enabled).lower()}", "A100D-10C")
            allocator = rt.ctx.allocator
            assert (allocator is not None) is enabled and vm.state == "placed"
            assert allocator is None or allocator.stats["claims"] == 1
        finally:
            rt.close()
    with Controller(url) as admin:
        assert usage(admin)[("*", "vms")] == 2
        check_store_invariants(admin.engine)


def test_a_bad_allocator_setting_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nallocator = "yes"\n')
    with pytest.raises(InvalidInput) as err:
        load_config(path, {})
    assert err.value.reasons == [{"field": "allocator", "value": "yes"}]
    assert "allocator 'yes' must be true or false" in err.value.message
