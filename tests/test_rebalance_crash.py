"""A rebalance move killed with kill -9 at each of its steps (VGPU_CTL_FAULT_MOVE makes the `vgpuctl rebalance
--apply` process kill itself there): reconcile reports the interrupted move (not clean, exit 1) and `reconcile
--fix` (or the server's leader, on its tick) finishes it from step done and rolls it back before, so the VM runs on
exactly one placement, nothing is left on either host, quota and usage are as before, and it is audited. On
SQLite and PostgreSQL, across hosts and on one host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import DEMO, Cli, check_store_invariants
from tests.test_rebalance_apply import on_host, seed_two_hosts, usage
from vgpu_ctl import Controller
from vgpu_ctl.service.provision import domain_name
from vgpu_ctl.service.rebalance import CRASH_ENV
from vgpu_ctl.store import tables
from vgpu_ctl.store.moves import MOVE

VGPUCTL = str(Path(sys.executable).with_name("vgpuctl"))
BEFORE_DONE = ("stopped", "claimed", "created", "defined", "started")  # rolled back
FROM_DONE = ("done", "removed")  # finished


def _across(c: Controller, tmp_path: Path) -> str:
    """Two simulated hosts with a VM each: free-hosts moves one VM to the other host."""
    seed_two_hosts(c, tmp_path)
    return "free-hosts"


def _same_host(c: Controller, tmp_path: Path) -> str:
    """The demo's L40S host with three small VMs: free-gpus moves one to another GPU of the same host."""
    c.apply_inventory(DEMO)
    c.create_tenant("acme")
    for n in range(3):
        c.request_vm("acme", f"w{n}", "L40S-8C", vcpus=4, memory_mib=16384, pool="workstations")
    return "free-gpus"


def _placement(c: Controller, name: str) -> tuple[str, list[tuple[str, int]]]:
    vm = c.get_vm(f"acme/{name}")
    return vm.host or "", sorted((d.gpu, d.start) for d in vm.devices)


def _crash(url: str, goal: str, point: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, CRASH_ENV: point}
    return subprocess.run([VGPUCTL, "--db", url, "rebalance", "--apply", "--yes", "--goal", goal],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def _hosts_holding(c: Controller, uuids: set[str], domain: str) -> dict[str, tuple[set[str], bool | None]]:
    """Per host: which of `uuids` it has, and whether it has the domain (running or not; None: absent)."""
    with c.engine.connect() as conn:
        names = [r.name for r in conn.execute(select(tables.HOST.c.name))]
    out = {}
    for h in names:
        devs, domains = on_host(c, h)
        out[h] = (devs & uuids, domains.get(domain))
    return out


# every point across hosts; on one host the points where its undo differs (the old definition put back)
CASES = [*(("across", p) for p in (*BEFORE_DONE, *FROM_DONE)),
         *(("same-host", p) for p in ("created", "defined", "started", "done"))]


@pytest.mark.parametrize(("layout", "point"), CASES)
def test_a_move_killed_at_each_step_is_settled_by_reconcile(store_url: str, state_dir: Path, tmp_path: Path,
                                                            layout: str, point: str) -> None:
    with Controller(store_url) as c:
        goal = (_across if layout == "across" else _same_host)(c, tmp_path)
        (move,) = c.rebalance_plan(goal=goal).moves
        before_usage, before_sums = usage(c), check_store_invariants(c.engine)
        before_place = _placement(c, move.name)
        events_before = len(c.events())
    crashed = _crash(store_url, goal, point)
    assert crashed.returncode == -9, (crashed.returncode, crashed.stdout, crashed.stderr)
    cli = Cli(store_url)
    with Controller(store_url) as c, c.engine.connect() as conn:
        (row,) = conn.execute(select(MOVE)).all()
    report = cli.json("reconcile", code=1)
    (found,) = [f for f in report["findings"] if f["kind"] == "interrupted-move"]
    forward = point in FROM_DONE
    assert not report["clean"] and found["target"] == f"vm:{move.vm}"
    assert found["action"] == ("finish move" if forward else "roll back move") and not found["fixed"]
    assert [f["kind"] for f in report["findings"]] == ["interrupted-move"], report  # no lost-vm, no orphan
    assert row.step == {"stopped": "stopping", "claimed": "claimed", "created": "claimed", "defined": "claimed",
                        "started": "defined", "done": "done", "removed": "done"}[point]

    fixed = cli.json("reconcile", "--fix", "--yes")
    assert fixed["clean"], fixed
    with Controller(store_url) as c:
        vm = c.get_vm(move.vm)
        assert vm.state == "running"
        host, devices = _placement(c, move.name)
        if forward:
            assert host == move.to_host and devices == sorted(
                (f"{move.to_host}/{d.pci}", d.start) for d in move.to_devices)
        else:
            assert (host, devices) == before_place
        held = _hosts_holding(c, {d.uuid for d in vm.devices}, domain_name(vm))
        assert {h: v for h, v in held.items() if v != (set(), None)} == {host: ({d.uuid for d in vm.devices}, True)}
        for h in held:  # nothing of the other placement left on any host: only its own devices, known to the store
            uuids, _domains = on_host(c, h)
            with c.engine.connect() as conn:
                known = {r.uuid for r in conn.execute(select(tables.DEVICE.c.uuid))}
            assert uuids <= known, h
        assert usage(c) == before_usage
        assert check_store_invariants(c.engine) == before_sums
        with c.engine.connect() as conn:
            assert conn.execute(select(MOVE)).all() == []
        moves = [e for e in c.events()[events_before:] if e["action"] == "vm.move"]
        assert [e["result"] for e in moves] == (["ok"] if forward else ["failed"])
        assert f"interrupted at step {row.step}" in moves[0]["error"]
        assert ("finished by reconcile" if forward else "rolled back by reconcile") in moves[0]["error"]
        assert c.reconcile().findings == []


@pytest.mark.parametrize("point", ["started", "done"])
def test_the_leader_settles_an_interrupted_move_on_its_tick(sqlite_url: str, state_dir: Path, tmp_path: Path,
                                                            point: str) -> None:
    from vgpu_ctl.server.config import ServerConfig
    from vgpu_ctl.server.metrics import server_metrics
    from vgpu_ctl.server.runtime import Runtime
    with Controller(sqlite_url) as c:
        goal = _across(c, tmp_path)
        (move,) = c.rebalance_plan(goal=goal).moves
        before_usage = usage(c)
    assert _crash(sqlite_url, goal, point).returncode == -9
    # reconcile's loop off: the leader's own tick settles it, as it takes over operations left behind
    cfg = ServerConfig(store=sqlite_url, state_dir=str(state_dir), reconcile_interval_s=0,
                       recovery_interval_s=0.1, utilization_interval_s=0, drain_timeout_s=5).check()
    rt = Runtime(cfg)
    try:
        deadline = time.monotonic() + 30
        while rt.stats.moves_settled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.stats.moves_settled == 1 and rt.stats.reconcile_runs == 0
        assert "vgpu_rebalance_moves_settled_total 1" in server_metrics(rt)
    finally:
        rt.close()
    with Controller(sqlite_url) as c:
        where = move.to_host if point == "done" else move.from_host
        assert _placement(c, move.name)[0] == where and c.get_vm(move.vm).state == "running"
        assert usage(c) == before_usage
        with c.engine.connect() as conn:
            assert conn.execute(select(MOVE)).all() == []
        assert c.reconcile().findings == []


def test_a_move_a_live_process_holds_is_in_progress_and_left_alone(sqlite_url: str, state_dir: Path,
                                                                   tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    with Controller(sqlite_url) as c:
        goal = _across(c, tmp_path)
        (move,) = c.rebalance_plan(goal=goal).moves
    env = {**os.environ, "VGPU_CTL_SIM_HOLD": f"start_domain={gate}"}
    proc = subprocess.Popen([VGPUCTL, "--db", sqlite_url, "rebalance", "--apply", "--yes", "--goal", goal], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{gate}.waiting").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"{gate}.waiting").exists(), "the move never reached its start"
        cli = Cli(sqlite_url)
        report = cli.json("reconcile", "--fix", "--yes", code=1)
        assert [(f["kind"], f["target"], f["action"]) for f in report["findings"]] == [
            ("in-progress", f"vm:{move.vm}", "wait")]
        gate.unlink()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
    finally:
        if proc.poll() is None:
            proc.kill()
    with Controller(sqlite_url) as c:
        assert _placement(c, move.name)[0] == move.to_host and c.reconcile().findings == []
