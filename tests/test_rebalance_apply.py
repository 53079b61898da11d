"""vgpuctl rebalance --apply: moves carried out one at a time on simulated hosts, each audited (vm.move with from
and to), quota unchanged, the store's invariants kept; a failed move leaves its VM running where it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.conftest import Cli, check_store_invariants, store_snapshot, write_inventory
from vgpu_ctl import Controller
from vgpu_ctl.hosts.protocol import DeviceHandle, DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service.hosts import HostFactory
from vgpu_ctl.store import tables

TWO_HOSTS = """
pools:
  - {name: ws, policy: spread}
hosts:
  - name: sim-a
    uri: "simulated:///sim-a"
    driver: simulated
    vcpus: 32
    memory_mib: 131072
    gpus:
      - {pci: "0000:17:00.0", model: L40S, mode: vgpu-mixed, pool: ws}
  - name: sim-b
    uri: "simulated:///sim-b"
    driver: simulated
    vcpus: 32
    memory_mib: 131072
    gpus:
      - {pci: "0000:17:00.0", model: L40S, mode: vgpu-mixed, pool: ws}
"""


class FailingHost(SimulatedHost):
    """A simulated host that raises at one step, the first time it is taken."""

    def __init__(self, name: str, state_dir: Path, step: str) -> None:
        super().__init__(name, state_dir)
        self.step, self.failed = step, False

    def _maybe_fail(self, step: str) -> None:
        if step == self.step and not self.failed:
            self.failed = True
            raise RuntimeError(f"injected failure at {step}")

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        self._maybe_fail("create_device")
        return super().create_device(spec)

    def define_domain(self, xml: str) -> str:
        self._maybe_fail("define_domain")
        return super().define_domain(xml)

    def start_domain(self, name: str) -> None:
        self._maybe_fail("start_domain")
        super().start_domain(name)


class FailingFactory(HostFactory):
    """Hosts as usual, but `host` fails at `step`."""

    def __init__(self, state_path: Path, host: str, step: str) -> None:
        super().__init__(state_path)
        self.host, self.step = host, step

    def _open(self, host: Any) -> Any:
        if host.name == self.host:
            return FailingHost(host.name, self.state_path / "hosts", self.step)
        return super()._open(host)


def usage(c: Controller) -> list[dict[str, Any]]:
    """Every tenant's usage columns (global and scoped)."""
    with c.engine.connect() as conn:
        tenants = [dict(r._mapping) for r in conn.execute(tables.TENANT.select().order_by(tables.TENANT.c.id))]
        scoped = [dict(r._mapping) for r in conn.execute(tables.SCOPED.select().order_by(tables.SCOPED.c.id))]
    for t in tenants:
        t.pop("generation", None)
        t.pop("updated_at", None)
    return tenants + scoped


def on_host(c: Controller, host: str) -> tuple[set[str], dict[str, bool]]:
    """The device uuids and the domains (name -> running) a simulated host has."""
    with c.engine.connect() as conn:
        row = conn.execute(tables.HOST.select().where(tables.HOST.c.name == host)).one()
    driver = c.hosts.get(row)
    return {d.uuid for d in driver.list_devices()}, {d.name: d.active for d in driver.list_domains()}


def vm_devices(c: Controller, name: str) -> list[tuple[str, str, int]]:
    """A VM's (host/pci, profile, start)."""
    return sorted((d.gpu, d.profile, d.start) for d in c.get_vm(f"acme/{name}").devices)


def test_apply_on_the_demo_moves_one_vm_with_an_event(cli: Cli) -> None:
    for n in range(3):
        cli.json("vm", "create", "--tenant", "acme", "--name", f"w{n}", "--profile", "L40S-8C", "--vcpus", "4",
                 "--memory", "16GiB", "--pool", "workstations")
    plan = cli.json("rebalance", "--plan")
    (move,) = plan["moves"]
    with Controller(cli.url) as c:
        before_usage = usage(c)
        before_sums = check_store_invariants(c.engine)
        old_uuids = {d.uuid for d in c.get_vm(move["vm"]).devices}
    out = cli.json("rebalance", "--apply", "--yes")
    assert out["done"] and [a["vm"] for a in out["applied"]] == [move["vm"]]
    with Controller(cli.url) as c:
        vm = c.get_vm(move["vm"])
        assert vm.state == "running"
        (dev,) = vm.devices
        to = move["to"]["devices"][0]
        assert (dev.gpu, dev.profile, dev.start) == (f"kvm-l40s-01/{to['pci']}", to["profile"], to["start"])
        assert usage(c) == before_usage  # a move charges nothing
        assert check_store_invariants(c.engine) == before_sums
        uuids, domains = on_host(c, "kvm-l40s-01")
        assert dev.uuid in uuids and not old_uuids & uuids  # the old mdev is gone, the new one exists
        assert sum(domains.values()) == 3
        assert c.reconcile().findings == []
        ev = [e for e in c.events() if e["action"] == "vm.move"]
        assert len(ev) == 1 and ev[0]["result"] == "ok"
        assert ev[0]["params"]["from"] == {"host": "kvm-l40s-01", "devices": [
            {k: v for k, v in move["from"]["devices"][0].items() if k != "size"}]}
        assert ev[0]["params"]["to"]["devices"][0]["pci"] == to["pci"]
    # Freed: a new plan has nothing left to do on that pool.
    assert cli.json("rebalance", "--plan", "--pool", "workstations")["moves"] == []


def test_without_an_answer_nothing_moves_and_a_yes_moves(cli: Cli) -> None:
    for n in range(3):
        cli.json("vm", "create", "--tenant", "acme", "--name", f"w{n}", "--profile", "L40S-8C", "--vcpus", "4",
                 "--memory", "16GiB", "--pool", "workstations")
    with Controller(cli.url) as c:
        before = store_snapshot(c)
    from vgpu_ctl.cli.main import app
    runner = CliRunner()
    for answer in ("", "n\n"):
        result = runner.invoke(app, ["--db", cli.url, "rebalance", "--apply"], input=answer)
        assert result.exit_code == 1, result.output
        assert "not confirmed" in result.output
        with Controller(cli.url) as c:
            assert store_snapshot(c) == before
    result = runner.invoke(app, ["--db", cli.url, "rebalance", "--apply"], input="y\n")
    assert result.exit_code == 0, result.output
    assert "moved acme/w" in result.output


def test_a_tenant_token_may_not_apply(cli: Cli) -> None:
    token = cli("tenant", "token", "acme").stdout.strip().split()[-1]
    from vgpu_ctl.cli.main import app
    result = CliRunner().invoke(app, ["--db", cli.url, "--token", token, "rebalance", "--apply", "--yes",
                                      "-o", "json"])
    assert result.exit_code == 7, result.output
    assert json.loads(result.stdout)["error"]["code"] == "permission_denied"


def seed_two_hosts(c: Controller, folder: Path) -> None:
    """Two simulated hosts of one L40S each in a spread pool, a VM on each (tenant acme, a quota set)."""
    c.apply_inventory(write_inventory(folder, TWO_HOSTS))
    c.create_tenant("acme")
    c.set_quota("acme", {"vms": 10, "vcpus": 64})
    c.set_quota("acme", {"vgpus": 4}, pool="ws")
    c.request_vm("acme", "a", "L40S-8C", vcpus=4, memory_mib=8192, pool="ws")
    c.request_vm("acme", "b", "L40S-8C", vcpus=4, memory_mib=8192, pool="ws")
    assert {c.get_vm("acme/a").host, c.get_vm("acme/b").host} == {"sim-a", "sim-b"}


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """`seed_two_hosts` on a SQLite store under tmp_path: its URL and the hosts' state folder."""
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    url = f"sqlite:///{tmp_path / 'rb.db'}"
    with Controller(url, state_path=tmp_path) as c:
        seed_two_hosts(c, tmp_path)
    return url, tmp_path


def _host_used(c: Controller) -> dict[str, tuple[int, int]]:
    with c.engine.connect() as conn:
        return {r.name: (r.used_vcpus, r.used_memory_mib) for r in conn.execute(tables.HOST.select())}


@pytest.mark.parametrize("step", ["create_device", "define_domain", "start_domain"])
def test_a_failure_at_the_new_host_leaves_the_vm_running_where_it_was(two_hosts: tuple[str, Path],
                                                                      step: str) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        plan = c.rebalance_plan()
        (move,) = plan.moves
        target = move.to_host
        mover = move.name
        before = store_snapshot(c)
        before_sums = check_store_invariants(c.engine)
        before_devs = vm_devices(c, mover)
        before_target = on_host(c, target)
    with Controller(url, state_path=state, host_factory=FailingFactory(state, target, step)) as c:
        report = c.rebalance_apply(plan.moves)
    assert not report["done"] and report["applied"] == []
    assert report["failed"]["code"] == "host_failure" and f"injected failure at {step}" in report["failed"]["error"]
    with Controller(url, state_path=state) as c:
        vm = c.get_vm(f"acme/{mover}")
        assert vm.state == "running" and vm.host == move.from_host
        assert vm_devices(c, mover) == before_devs
        after = store_snapshot(c)
        moves = [e for e in after.pop("events") if e not in before["events"]]
        assert [(e["action"], e["result"]) for e in moves] == [("vm.move", "failed")]
        before.pop("events")
        for key in ("vms", "gpus", "tenants", "hosts"):  # generations aside, as they were
            strip = [{k: v for k, v in r.items() if k not in ("generation", "updated_at", "version", "lease_expires")}
                     for r in after[key]]
            was = [{k: v for k, v in r.items() if k not in ("generation", "updated_at", "version", "lease_expires")}
                   for r in before[key]]
            assert strip == was, key
        assert after["devices"] == before["devices"]
        assert check_store_invariants(c.engine) == before_sums
        assert on_host(c, target) == before_target  # nothing left behind on the new host
        uuids, domains = on_host(c, move.from_host)
        assert {d.uuid for d in vm.devices} <= uuids and domains and all(domains.values())  # running there
        assert c.reconcile().findings == []


def test_a_move_across_hosts_frees_the_host_and_keeps_quota(two_hosts: tuple[str, Path]) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        plan = c.rebalance_plan(goal="free-hosts")
        (move,) = plan.moves
        assert move.from_host != move.to_host
        before_usage = usage(c)
        sums = check_store_invariants(c.engine)
        report = c.rebalance_apply(plan.moves)
        assert report["done"], report
        vm = c.get_vm(f"acme/{move.name}")
        assert vm.host == move.to_host and vm.state == "running"
        assert usage(c) == before_usage
        assert check_store_invariants(c.engine) == sums
        used = _host_used(c)
        assert used[move.from_host] == (0, 0) and used[move.to_host] == (8, 16384)
        assert on_host(c, move.from_host) == (set(), {})
        uuids, domains = on_host(c, move.to_host)
        assert len(uuids) == 2 and list(domains.values()) == [True, True]
        assert c.reconcile().findings == []
        assert c.rebalance_plan(goal="free-hosts").moves == ()


def test_a_plan_gone_stale_is_refused_with_nothing_changed(two_hosts: tuple[str, Path]) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        plan = c.rebalance_plan()
        (move,) = plan.moves
        c.stop_vm(f"acme/{move.name}")
        c.start_vm(f"acme/{move.name}")
        c.release_vm(f"acme/{'a' if move.name == 'b' else 'b'}")  # the destination's VM goes: it is empty now
        before = store_snapshot(c)
        report = c.rebalance_apply(plan.moves)
        # The GPU it would go to is empty but still free: the move is valid by geometry and is carried out;
        # a move whose VM changed place is refused.
        assert report["done"]
        stale = c.rebalance_apply(plan.moves)
        assert not stale["done"] and stale["failed"]["code"] == "conflict"
        assert "changed since the plan" in stale["failed"]["error"]
        after = store_snapshot(c)
        assert after["devices"] != before["devices"]
        assert check_store_invariants(c.engine)


@pytest.mark.parametrize("step", ["create_device", "define_domain", "start_domain"])
def test_a_failed_move_on_the_same_host_gets_its_old_domain_back(cli: Cli, step: str) -> None:
    for n in range(3):
        cli.json("vm", "create", "--tenant", "acme", "--name", f"w{n}", "--profile", "L40S-8C", "--vcpus", "4",
                 "--memory", "16GiB", "--pool", "workstations")
    with Controller(cli.url) as c:
        plan = c.rebalance_plan(pool="workstations")
        (move,) = plan.moves
        assert move.from_host == move.to_host == "kvm-l40s-01"
        before = store_snapshot(c)["devices"]
        sums = check_store_invariants(c.engine)
        state = c.state_path
    with Controller(cli.url, state_path=state, host_factory=FailingFactory(state, "kvm-l40s-01", step)) as c:
        report = c.rebalance_apply(plan.moves)
    assert report["failed"]["code"] == "host_failure", report
    with Controller(cli.url) as c:
        vm = c.get_vm(move.vm)
        assert vm.state == "running" and store_snapshot(c)["devices"] == before
        assert check_store_invariants(c.engine) == sums
        with c.engine.connect() as conn:
            host = conn.execute(tables.HOST.select().where(tables.HOST.c.name == "kvm-l40s-01")).one()
        domain = next(d for d in c.hosts.get(host).list_domains() if d.uuid == vm.id)
        assert domain.active
        assert set(domain.hostdevs) == {d.uuid for d in vm.devices}  # the old definition
        assert on_host(c, "kvm-l40s-01")[0] == {d.uuid for v in c.list_vms() for d in v.devices}
        assert c.reconcile().findings == []


def test_readme_rebalance_example(cli: Cli) -> None:
    outputs = cli.readme_block(r"### Rebalance\n")
    plan = next(out for args, out in outputs if "--plan" in args)
    assert "1 move of 1 VM free 1 GPU" in plan
    applied = next(out for args, out in outputs if "--apply" in args)
    assert "moved acme/w" in applied
    events = next(out for args, out in outputs if args == ["events"])
    assert "vm.move" in events
    assert cli.json("rebalance", "--plan", "--pool", "workstations")["moves"] == []


def _generated_inventory(seed: int) -> str:
    import random
    rng = random.Random(seed)
    lines = ["pools:", "  - {name: g, policy: spread}", "hosts:"]
    for h in range(3):
        lines += [f"  - name: gen-{h}", f'    uri: "simulated:///gen-{h}"', "    driver: simulated",
                  "    vcpus: 64", "    memory_mib: 262144", "    gpus:"]
        for j in range(rng.randint(1, 3)):
            model = rng.choice(["H100-80GB", "L40S"])
            mode = "mig" if model == "H100-80GB" else "vgpu-mixed"
            lines.append(f'      - {{pci: "0000:{0x17 + j:02x}:00.0", model: {model}, mode: {mode}, pool: g}}')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_apply_on_a_generated_fleet_frees_what_the_plan_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              seed: int) -> None:
    import random

    from vgpu_ctl.errors import Refused
    rng = random.Random(seed)
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    with Controller(f"sqlite:///{tmp_path / 'g.db'}", state_path=tmp_path) as c:
        c.apply_inventory(write_inventory(tmp_path, _generated_inventory(seed)))
        c.create_tenant("acme")
        names = []
        for n in range(14):
            profile = rng.choice(["H100-1-10C", "H100-2-20C", "L40S-8C", "L40S-12C", "L40S-4C"])
            try:
                c.request_vm("acme", f"v{n}", profile, vcpus=2, memory_mib=4096, pool="g")
                names.append(f"v{n}")
            except Refused:
                continue
        for name in rng.sample(names, len(names) // 3):
            c.release_vm(f"acme/{name}")
        for name in rng.sample(sorted(set(names) - {e["params"]["name"] for e in c.events()
                                                    if e["action"] == "vm.delete"}), 2):
            c.stop_vm(f"acme/{name}")  # stopped VMs move too, and stay stopped
        states = {v.name: v.state for v in c.list_vms()}
        plan = c.rebalance_plan()
        assert plan.moves, "a spread fleet with departures has GPUs to free"
        before_usage, sums = usage(c), check_store_invariants(c.engine)
        report = c.rebalance_apply(plan.moves)
        assert report["done"] and len(report["applied"]) == len(plan.moves)
        assert usage(c) == before_usage and check_store_invariants(c.engine) == sums
        assert {v.name: v.state for v in c.list_vms()} == states
        moves = [e for e in c.events() if e["action"] == "vm.move"]
        assert [e["params"]["name"] for e in moves] == [m.name for m in plan.moves]
        with c.engine.connect() as conn:
            in_use = conn.execute(tables.GPU.select().where(tables.GPU.c.device_count > 0)).all()
        assert len(in_use) == plan.to_dict()["summary"]["in_use_gpus_after"]
        for f in plan.freed:
            assert not any(g.pci_address == f.pci and g.host_id == _host_id(c, f.host) for g in in_use)
        assert c.reconcile().findings == []


def _host_id(c: Controller, name: str) -> int:
    with c.engine.connect() as conn:
        return int(conn.execute(tables.HOST.select().where(tables.HOST.c.name == name)).one().id)


def test_the_api_refuses_a_tenant(cli: Cli) -> None:
    from vgpu_ctl.errors import PermissionDenied
    token = cli("tenant", "token", "acme").stdout.strip().split()[-1]
    with Controller(cli.url, token=token) as c:
        with pytest.raises(PermissionDenied):
            c.rebalance_plan()
        with pytest.raises(PermissionDenied):
            c.rebalance_apply(())


def _undo_cli(url: str, state: Path, *args: str, input: str | None = None) -> Any:
    from vgpu_ctl.cli.main import app
    return CliRunner().invoke(app, ["--db", url, "rebalance", "--undo", *args], input=input,
                              env={"VGPU_CTL_STATE_DIR": str(state)})


def test_undo_moves_the_vm_back_where_its_last_move_took_it_from(two_hosts: tuple[str, Path]) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        (move,) = c.rebalance_plan(goal="free-hosts").moves
        before_usage, before_sums = usage(c), check_store_invariants(c.engine)
        before_devs, before_used = vm_devices(c, move.name), _host_used(c)
        assert c.rebalance_apply([move])["done"]
        assert c.get_vm(move.vm).host == move.to_host
    answered = _undo_cli(url, state, f"acme/{move.name}", input="n\n")
    assert answered.exit_code == 1 and "not confirmed" in answered.output, answered.output
    done = _undo_cli(url, state, f"acme/{move.name}", "--yes", "--json")
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    with Controller(url, state_path=state) as c:
        vm = c.get_vm(move.vm)
        assert vm.state == "running" and vm.host == move.from_host and vm_devices(c, move.name) == before_devs
        assert usage(c) == before_usage and check_store_invariants(c.engine) == before_sums
        assert _host_used(c) == before_used
        uuids, domains = on_host(c, move.to_host)
        assert not {d.uuid for d in vm.devices} & uuids and len(domains) == 1  # only the other VM's
        moved = [e for e in c.events() if e["action"] == "vm.move"]
        assert [e["result"] for e in moved] == ["ok", "ok"] and moved[1]["params"]["undoes"] == moved[0]["id"]
        assert out["undoes"] == moved[0]["id"] and out["to"].startswith(move.from_host)
        assert moved[1]["params"]["to"] == moved[0]["params"]["from"]
        assert c.reconcile().findings == []


def test_undo_is_refused_with_nothing_changed(two_hosts: tuple[str, Path]) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        before = store_snapshot(c)
    never = _undo_cli(url, state, "acme/a", "--yes", "-o", "json")
    assert never.exit_code == 2 and "never moved" in json.loads(never.stdout)["error"]["message"], never.output
    assert json.loads(never.stdout)["error"]["reasons"] == [{"field": "vm", "value": "acme/a"}]
    unknown = _undo_cli(url, state, "acme/nope", "--yes")
    assert unknown.exit_code == 4, unknown.output
    mixed = _undo_cli(url, state, "acme/a", "--apply", "--yes")
    assert mixed.exit_code == 2 and "--undo goes alone" in mixed.output, mixed.output
    with Controller(url, state_path=state) as c:
        assert store_snapshot(c) == before
        (move,) = c.rebalance_plan(goal="free-hosts").moves
        assert c.rebalance_apply([move])["done"]
        # the emptied host's GPU takes a new VM where the moved one was: the way back is taken
        c.request_vm("acme", "c", "L40S-8C", vcpus=4, memory_mib=8192, pool="ws")
        assert c.get_vm("acme/c").host == move.from_host
        taken = store_snapshot(c)
        on_to = on_host(c, move.to_host)
    refused = _undo_cli(url, state, f"acme/{move.name}", "--yes")
    assert refused.exit_code == 5 and "no longer fits" in refused.output, refused.output
    with Controller(url, state_path=state) as c:
        assert store_snapshot(c) == taken and on_host(c, move.to_host) == on_to  # not even stopped


def test_undo_is_an_admin_command(two_hosts: tuple[str, Path]) -> None:
    url, state = two_hosts
    with Controller(url, state_path=state) as c:
        token = c.issue_token("acme")
        before = store_snapshot(c)
    from vgpu_ctl.cli.main import app
    res = CliRunner().invoke(app, ["--db", url, "--token", token, "rebalance", "--undo", "acme/a", "--yes"],
                             env={"VGPU_CTL_STATE_DIR": str(state)})
    assert res.exit_code == 7, res.output
    with Controller(url, state_path=state) as c:
        assert store_snapshot(c) == before
