"""Borrowing (issue 13, section 4): a quota's guaranteed part beside its limit (the burst). A tenant borrows idle
capacity above its guarantee up to its limit and no further; a VM is borrowed when it and its tenant's older VMs
pass a guarantee, as the usage stands now (so a release can make newer work guaranteed); the views show
guarantee, limit, usage and what is borrowed; bad guarantees are refused naming the field, nothing changed; the
migration goes down and up with VMs in the store."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from conftest import DEMO, Cli, check_store_invariants, store_snapshot
from sqlalchemy import text

from vgpu_ctl import Controller
from vgpu_ctl.errors import InvalidInput, QuotaExceeded
from vgpu_ctl.service import scheduling
from vgpu_ctl.store import migrate

SLICE = "A100D-10C"  # the demo's inference pool has one A100 pinned to it: 8 of these


def small(ctl: Controller, tenant: str, name: str) -> Any:
    return ctl.request_vm(tenant, name, [(SLICE, 1)], vcpus=1, memory_mib=1024, pool="inference")


def borrowed(ctl: Controller) -> dict[str, bool]:
    with ctl.engine.connect() as conn:
        rows = conn.execute(text("SELECT id, name, tenant_id FROM vm")).all()
        now = scheduling.borrowed_vms(conn, {r.tenant_id for r in rows})
    return {r.name: r.id in now for r in rows}


def row(rows: list[dict[str, Any]], resource: str, scope: str = "*") -> dict[str, Any]:
    return next(r for r in rows if r["resource"] == resource and r["scope"] == scope)


def test_borrow_up_to_the_burst_and_no_further(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    changes = ctl.set_quota("acme", {"vgpus": 6}, guarantees={"vgpus": 4})
    assert changes == {"vgpus": 6, "guarantee:vgpus": 4}
    for i in range(6):
        small(ctl, "acme", f"vm{i}")
    # borrowed: the newest past the guarantee, the 5th and 6th
    assert borrowed(ctl) == {f"vm{i}": i >= 4 for i in range(6)}
    with pytest.raises(QuotaExceeded) as exc:  # GPUs are idle (2 slots left), but the burst is reached
        small(ctl, "acme", "vm6")
    assert exc.value.reasons == [{"kind": "quota", "tenant": "acme", "scope": "*", "resource": "vgpus",
                                  "limit": 6, "used": 6, "requested": 1}]
    usage = row(ctl.tenant_usage("acme"), "vgpus")
    assert (usage["guarantee"], usage["limit"], usage["used"], usage["borrowed"]) == (4, 6, 6, 2)
    assert row(ctl.tenant_usage("acme"), "vms")["borrowed"] is None  # no guarantee: nothing to borrow against
    # releasing a guaranteed VM: the oldest borrowed one (vm4) is within the guarantee now, so guaranteed
    ctl.release_vm("acme/vm0")
    assert borrowed(ctl) == {f"vm{i}": i == 5 for i in range(1, 6)}
    small(ctl, "acme", "again")  # usage 6 again: the newest two are borrowed
    assert borrowed(ctl) == {**{f"vm{i}": i == 5 for i in range(1, 6)}, "again": True}
    check_store_invariants(ctl.engine)


def test_no_guarantee_means_nothing_is_borrowed(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 3})
    for i in range(3):
        small(ctl, "acme", f"vm{i}")
    assert set(borrowed(ctl).values()) == {False}
    assert row(ctl.tenant_usage("acme"), "vgpus")["guarantee"] is None


def test_guarantee_in_a_pool_and_of_framebuffer(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 4}, pool="inference", guarantees={"vgpus": 1})
    ctl.set_quota("acme", {"framebuffer_mib": 40960}, guarantees={"framebuffer_mib": 20480})
    small(ctl, "acme", "a")  # 1 vGPU in the pool (= its guarantee), 10 GiB (< 20)
    small(ctl, "acme", "b")  # 2 > 1 in the pool: borrowed
    assert borrowed(ctl) == {"a": False, "b": True}
    rows = ctl.tenant_usage("acme")
    assert (row(rows, "vgpus", "inference")["guarantee"], row(rows, "vgpus", "inference")["borrowed"]) == (1, 1)
    fb = row(rows, "framebuffer_mib")
    assert (fb["guarantee"], fb["limit"], fb["used"], fb["borrowed"]) == (20480, 40960, 20480, 0)
    small(ctl, "acme", "c")  # framebuffer 30 GiB > 20 GiB too
    assert borrowed(ctl)["c"] is True
    check_store_invariants(ctl.engine)


@pytest.mark.parametrize(("limits", "guarantees", "pool", "field"), [
    ({"vgpus": 4}, {"vgpus": 5}, None, "guarantee_vgpus"),
    ({}, {"vgpus": -1}, None, "guarantee_vgpus"),
    ({}, {"framebuffer_mib": 1.5}, None, "guarantee_framebuffer_mib"),
    ({}, {"vgpus": 2}, "inference", "guarantee_vgpus"),  # a pool's guarantee needs a limit there
    ({"vgpus": 1}, {}, None, "vgpus"),  # lowering the limit below the guarantee already set
    ({}, {"profile:A100D-10C": 1}, None, "guarantee"),
])
def test_bad_guarantees_change_nothing(ctl: Controller, limits: dict[str, Any], guarantees: dict[str, Any],
                                       pool: str | None, field: str) -> None:
    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 8}, guarantees={"vgpus": 2})
    small(ctl, "acme", "a")
    before = store_snapshot(ctl)
    with pytest.raises(InvalidInput) as exc:
        ctl.set_quota("acme", limits, pool=pool, guarantees=guarantees)
    assert exc.value.reasons[0]["field"] == field, exc.value.reasons
    assert store_snapshot(ctl) == before


def test_the_store_refuses_bad_guarantees(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 4}, guarantees={"vgpus": 1})
    small(ctl, "acme", "a")
    with ctl.engine.connect() as conn, pytest.raises(Exception, match="guarantee"), conn.begin():
        conn.execute(text("UPDATE tenant SET vgpus_guarantee = 5 WHERE name = 'acme'"))
    assert borrowed(ctl) == {"a": False}


def test_cli_quota_set_with_guarantees(ctl: Controller, store_url: str) -> None:
    cli = Cli(store_url)
    ctl.create_tenant("acme")
    out = cli.json("quota", "set", "acme", "--vgpus", "8", "--guarantee-vgpus", "4", "--framebuffer", "80GiB",
                   "--guarantee-framebuffer", "40GiB")
    assert out["limits"] == {"vgpus": 8, "framebuffer_mib": 81920, "guarantee:vgpus": 4,
                             "guarantee:framebuffer_mib": 40960}
    small(ctl, "acme", "a")
    usage = cli.json("tenant", "usage", "acme")["usage"]
    assert row(usage, "vgpus") == {"scope": "*", "resource": "vgpus", "used": 1, "limit": 8, "guarantee": 4,
                                   "borrowed": 0}
    shown = cli("tenant", "usage", "acme")
    assert shown.exit_code == 0 and "guarantee" in shown.output and "borrowed" in shown.output
    before = store_snapshot(ctl)
    res = cli("quota", "set", "acme", "--guarantee-vgpus", "9")
    assert res.exit_code == 2 and "guarantee_vgpus" in res.output, res.output
    res = cli("quota", "set", "acme", "--guarantee-vgpus", "-1")
    assert res.exit_code == 2 and "guarantee-vgpus" in res.output, res.output
    assert store_snapshot(ctl) == before
    cli.json("quota", "set", "acme", "--guarantee-vgpus", "none")
    assert row(ctl.tenant_usage("acme"), "vgpus")["guarantee"] is None


def generation(c: Controller, tenant: str) -> int:
    with c.engine.connect() as conn:
        return int(conn.execute(text("SELECT generation FROM tenant WHERE name = :n"), {"n": tenant}).scalar_one())


def test_migration_0007_down_and_up_with_vms(store_url: str, state_dir: Path) -> None:
    with Controller(store_url) as c:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        c.set_quota("acme", {"vgpus": 4}, guarantees={"vgpus": 1})
        small(c, "acme", "a")
        small(c, "acme", "b")
        command.downgrade(migrate.alembic_config(c.engine), "0006")
        with c.engine.connect() as conn:
            cols = set(conn.execute(text("SELECT * FROM tenant")).keys())
            # PostgreSQL drops the columns; SQLite empties them (it can't drop a column a CHECK names)
            assert "vgpus_guarantee" not in cols or conn.execute(
                text("SELECT count(*) FROM tenant WHERE vgpus_guarantee IS NOT NULL")).scalar() == 0
    with Controller(store_url) as c:  # opening the store upgrades it again: no guarantee, nothing borrowed
        assert borrowed(c) == {"a": False, "b": False}
        c.set_quota("acme", {"vgpus": 4}, guarantees={"vgpus": 1})
        gen = generation(c, "acme")
        small(c, "acme", "c")
        assert borrowed(c)["c"] is True
        c.release_vm("acme/a")  # the triggers of the rebuilt tables still work
        with c.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM usage_interval")).scalar() == 1
        assert generation(c, "acme") > gen
        gen = generation(c, "acme")
        with c.engine.connect() as conn, conn.begin():  # scoped rows still bump the tenant's generation
            conn.execute(text("INSERT INTO scoped_quota (tenant_id, scope, resource, limit_value, used) "
                              "SELECT id, 'training', 'vgpus', 3, 0 FROM tenant WHERE name = 'acme'"))
        assert generation(c, "acme") > gen
        check_store_invariants(c.engine)


def test_readme_borrowing_example(cli: Cli) -> None:
    outputs = cli.readme_block(r"## Scheduling\n.*?\*\*Borrowing\.\*\*")
    usage = next(out for args, out in outputs if args[:2] == ["tenant", "usage"])
    assert re.search(r"vgpus\s+│?\s*1\s+│?\s*0\s+│?\s*1\s+│?\s*1", usage), usage
    queue = next(out for args, out in outputs if args == ["queue"])
    assert "train" in queue
    assert sorted((v["tenant"], v["name"]) for v in cli.json("vm", "list")) == [("beta", "serve")]
    pre = next(e for e in cli.json("events") if e["action"] == "vm.preempt")
    assert pre["params"]["reason"] == "reclaim"


def test_concurrent_claims_borrow_exactly_what_passes_the_guarantee(ctl: Controller, store_url: str) -> None:
    """Eight claims at once from eight controllers: each charge is taken under the tenant row's lock, so the limit
    holds, and exactly the claims past the guarantee are borrowed: the five newest, whatever the order."""
    from concurrent.futures import ThreadPoolExecutor

    ctl.create_tenant("acme")
    ctl.set_quota("acme", {"vgpus": 8}, guarantees={"vgpus": 3})

    def claim(i: int) -> str:
        with Controller(store_url) as c:
            return str(small(c, "acme", f"vm{i}").id)

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(claim, range(8)))
    assert len(set(ids)) == 8
    flags = borrowed(ctl)
    assert sorted(flags.values()) == [False] * 3 + [True] * 5
    with ctl.engine.connect() as conn:  # in admission order: the first three are guaranteed
        order = [flags[r[0]] for r in conn.execute(text(
            "SELECT v.name FROM vm_sched s JOIN vm v ON v.id = s.vm_id ORDER BY s.admitted_at, v.id"))]
    assert order == [False] * 3 + [True] * 5
    check_store_invariants(ctl.engine)
