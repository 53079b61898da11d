"""Fair share: decayed usage from VMs' lifetimes (core.fairshare, half-life), folding the ledger exactly, Fair
Tree ranks among siblings and down accounts, what a 1g slice and a whole GPU are charged, and `vgpuctl share`."""

from __future__ import annotations

import math

import pytest
from conftest import Cli
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from vgpu_ctl import Controller, InvalidInput
from vgpu_ctl.core.fairshare import (
    Interval,
    Member,
    Usage,
    decayed_hours,
    decayed_usage,
    dominant,
    factors,
    fair_tree,
    fold,
)
from vgpu_ctl.service import scheduling

H = 3600.0


def test_no_decay_limit_is_plain_hours() -> None:
    assert decayed_hours(0, 2 * H, 2 * H, 1e12) == pytest.approx(2.0)


def test_half_life_halves_old_usage() -> None:
    # one hour of use that ended a half-life ago counts about half an hour
    recent = decayed_hours(99 * H, 100 * H, 100 * H, 10 * H)
    old = decayed_hours(89 * H, 90 * H, 100 * H, 10 * H)
    assert old == pytest.approx(recent / 2)
    assert decayed_hours(5 * H, 4 * H, 10 * H, H) == 0.0  # empty interval
    assert decayed_hours(0, 20 * H, 10 * H, 1e12) == pytest.approx(10.0)  # the future is not charged


def test_usage_weights_framebuffer_and_slices() -> None:
    u = decayed_usage([Interval(0, H, 10, 1), Interval(0, None, 80, 7)], H, 1e12)
    assert (u.fb_gib_h, u.compute_h) == (pytest.approx(90.0), pytest.approx(8.0))
    # a whole GPU held one hour on a 2-GPU fleet is half the fleet for an hour
    assert dominant(Usage(80, 7), 160, 14) == pytest.approx(0.5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 50), st.floats(0, 80), st.floats(0, 7)), max_size=6),
       st.floats(1, 200), st.floats(0, 100))
def test_fold_is_exact(raw: list[tuple[float, float, float, float]], half_life_h: float, later_h: float) -> None:
    ivs = [Interval(s * H, (s + d) * H, fb, c) for s, d, fb, c in raw]
    now = 160 * H
    then = now + later_h * H
    direct = decayed_usage(ivs, then, half_life_h * H)
    folded = fold(decayed_usage(ivs, now, half_life_h * H), now, then, half_life_h * H)
    assert folded.fb_gib_h == pytest.approx(direct.fb_gib_h, rel=1e-9, abs=1e-9)
    assert folded.compute_h == pytest.approx(direct.compute_h, rel=1e-9, abs=1e-9)


def test_fair_tree_ranks_siblings_by_shares_over_usage() -> None:
    rows = fair_tree([Member("a", None, 1, 1.0), Member("b", None, 1, 3.0), Member("c", None, 2, 0.0)])
    assert [r.name for r in rows] == ["c", "a", "b"]  # c has used nothing; a used less than b with equal shares
    got = {r.name: (r.rank, r.factor) for r in rows}
    assert got == {"c": (1, 1.0), "a": (2, pytest.approx(2 / 3)), "b": (3, pytest.approx(1 / 3))}
    a = next(r for r in rows if r.name == "a")
    assert (a.norm_shares, a.norm_usage, a.level_fs) == (0.25, 0.25, 1.0)


def test_fair_tree_walks_accounts_depth_first() -> None:
    # account "ml" used little overall, so all of its members rank before "web"'s, whatever their own usage
    members = [Member("ml", None, 1, account=True), Member("web", None, 1, account=True),
               Member("ml-heavy", "ml", 1, 2.0), Member("ml-light", "ml", 1, 0.5),
               Member("web-idle", "web", 1, 0.0), Member("web-busy", "web", 1, 10.0)]
    rows = fair_tree(members)
    assert [r.name for r in rows] == ["ml", "ml-light", "ml-heavy", "web", "web-idle", "web-busy"]
    assert factors(rows) == {"ml-light": 1.0, "ml-heavy": 0.75, "web-idle": 0.5, "web-busy": 0.25}
    assert next(r for r in rows if r.name == "ml").usage == 2.5


def test_fair_tree_equal_siblings_share_a_rank() -> None:
    rows = fair_tree([Member("a", None, 1, 1.0), Member("b", None, 1, 1.0)])
    assert [(r.rank, r.factor) for r in rows] == [(1, 1.0), (1, 1.0)]


def test_fair_tree_refuses_a_tenant_as_parent() -> None:
    with pytest.raises(InvalidInput, match="not an account"):
        fair_tree([Member("a", None, 1), Member("b", "a", 1)])


def _backdate(ctl: Controller, name: str, hours: float) -> None:
    """Make a VM look admitted `hours` ago (its usage interval started then)."""
    with ctl.engine.begin() as conn:
        conn.execute(text("UPDATE vm_sched SET admitted_at = admitted_at - :d WHERE vm_id = "
                          "(SELECT id FROM vm WHERE name = :n)"), {"d": hours * H, "n": name})


def test_whole_gpu_counts_more_than_a_slice(ctl: Controller) -> None:
    for t in ("small", "big"):
        ctl.create_tenant(t)
    ctl.scheduling.set_settings(half_life_s=1e9)  # hours barely decay: plain GiB-hours and slice-hours
    ctl.request_vm("small", "s", "1g.10gb", vcpus=2, memory_mib=4096)
    ctl.request_vm("big", "b", "A100-80GB", vcpus=2, memory_mib=4096)
    _backdate(ctl, "s", 2)
    _backdate(ctl, "b", 2)
    rows = {r["name"]: r for r in ctl.scheduling.share()}
    assert rows["small"]["compute_slice_hours"] == pytest.approx(2.0, rel=1e-3)
    assert rows["big"]["compute_slice_hours"] == pytest.approx(14.0, rel=1e-3)
    assert rows["big"]["fb_gib_hours"] == pytest.approx(160.0, rel=1e-3)
    assert rows["small"]["rank"] == 1 and rows["big"]["rank"] == 2
    # the usage of a deleted VM stays (closed by the store's trigger) and decays
    ctl.release_vm("big/b")
    again = {r["name"]: r for r in ctl.scheduling.share()}
    assert again["big"]["fb_gib_hours"] == pytest.approx(160.0, rel=1e-3)
    later = {r["name"]: r for r in ctl.scheduling.share(now=_now() + 1e9)}  # one half-life on
    assert later["big"]["fb_gib_hours"] == pytest.approx(80.0, rel=1e-3)


def _now() -> float:
    import time
    return time.time()


def test_compaction_keeps_the_numbers(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.scheduling.set_settings(half_life_s=1e9)
    for i in range(3):
        ctl.request_vm("acme", f"v{i}", "1g.10gb", vcpus=2, memory_mib=4096)
        _backdate(ctl, f"v{i}", i + 1)
        ctl.release_vm(f"acme/v{i}")
    now = _now()
    before = ctl.scheduling.share(now=now)
    with ctl.tx() as conn:
        assert scheduling.compact(conn, now, scheduling.settings(conn)["half_life_s"]) == 3
    after = ctl.scheduling.share(now=now)
    assert after[0]["compute_slice_hours"] == pytest.approx(before[0]["compute_slice_hours"], rel=1e-6)
    assert after[0]["compute_slice_hours"] == pytest.approx(6.0, rel=1e-3)
    with ctl.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM usage_interval")).scalar() == 0


def test_failed_vm_stops_being_charged(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.request_vm("acme", "a", "1g.10gb", vcpus=2, memory_mib=4096)
    with ctl.engine.begin() as conn:
        conn.execute(text("UPDATE vm SET state = 'failed' WHERE name = 'a'"))
        assert conn.execute(text("SELECT count(*) FROM vm_sched")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM usage_interval")).scalar() == 1


def test_cli_share_accounts_and_half_life(cli: Cli) -> None:
    cli.json("tenant", "create", "beta")
    cli.json("account", "set", "research", "--shares", "3")
    cli.json("tenant", "set", "acme", "--account", "research", "--shares", "2")
    rows = cli.json("share")
    # nobody used anything: every level fairshare is infinite, siblings go by name
    assert [(r["name"], r["kind"], r["depth"]) for r in rows] == [("beta", "tenant", 0), ("research", "account", 0),
                                                                  ("acme", "tenant", 1)]
    assert rows[1]["norm_shares"] == 0.75 and rows[2]["norm_shares"] == 1.0
    assert [(r["rank"], r["fairshare"]) for r in rows] == [(1, 1.0), (None, None), (2, 0.5)]
    assert cli.json("scheduling", "set", "--half-life", "12h")["half_life_s"] == 43200.0
    bad = cli.json("scheduling", "set", "--half-life", "0", code=2)
    assert bad["error"]["reasons"][0]["field"] == "half_life"
    bad = cli.json("scheduling", "set", "--grace", "soon", code=2)
    assert bad["error"]["reasons"][0]["field"] == "grace"
    assert cli.json("scheduling", "show")["half_life_s"] == 43200.0
    # a cycle or an unknown parent: exit 2, nothing changed
    cli.json("account", "set", "ml", "--parent", "research")
    bad = cli.json("account", "set", "research", "--parent", "ml", code=2)
    assert "cycle" in bad["error"]["message"]
    assert cli.json("account", "set", "x", "--parent", "nope", code=2)["error"]["reasons"][0]["field"] == "parent"
    assert [r["name"] for r in cli.json("share")] == ["beta", "research", "acme", "ml"]
    assert cli.json("account", "delete", "research", code=5)["error"]["code"] == "conflict"
    assert math.isfinite(cli.json("scheduling", "show")["grace_s"])


def test_an_account_and_a_tenant_may_share_a_name(cli: Cli) -> None:
    cli.json("account", "set", "acme", "--shares", "2")
    cli.json("tenant", "set", "acme", "--account", "acme")
    rows = cli.json("share")
    assert [(r["name"], r["kind"], r["parent"]) for r in rows] == [("acme", "account", None),
                                                                   ("acme", "tenant", "acme")]
