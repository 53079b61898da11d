"""Preemption in the service: a high-priority request frees lower-priority preemptible VMs (requeued, then
re-admitted when capacity frees, or cancelled), audited with preemptor, victims and reason; dry runs change
nothing; never for equal priority or non-preemptible VMs; the cool-down stops loops; the grace period; the queue
(`--queue`); and the invariants after any sequence of admit, preempt and release (hypothesis)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, Cli, assert_unchanged_but_refusal, check_store_invariants, store_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from vgpu_ctl import Controller, NoCapacity
from vgpu_ctl.errors import Refused
from vgpu_ctl.service import scheduling

WHOLE = "A100-80GB"  # the demo's training pool has one passthrough A100: one whole-GPU VM at a time


def classes(ctl: Controller) -> None:
    s = ctl.scheduling
    s.create_class("batch", 10, preemptible=True)
    s.create_class("scratch", 5, preemptible=True, preemption_mode="cancel")
    s.create_class("std", 100, preemptible=True, default=True)
    s.create_class("prod", 1000)
    s.create_class("urgent", 5000)
    for t in ("acme", "beta"):
        ctl.create_tenant(t)


def whole(ctl: Controller, tenant: str, name: str, **kw: Any) -> Any:
    return ctl.request_vm(tenant, name, WHOLE, vcpus=4, memory_mib=8192, pool="training", **kw)


def sched_row(ctl: Controller, name: str) -> dict[str, Any]:
    with ctl.engine.connect() as conn:
        return dict(conn.execute(text("SELECT s.* FROM vm_sched s JOIN vm v ON v.id = s.vm_id WHERE v.name = :n"),
                                 {"n": name}).one()._mapping)


def test_requeue_then_readmit(ctl: Controller) -> None:
    classes(ctl)
    low = whole(ctl, "acme", "train", priority="batch")
    high = whole(ctl, "beta", "serve", priority="prod")  # its class may preempt: no flag needed
    assert high.state == "running" and high.devices[0].gpu == low.devices[0].gpu
    check_store_invariants(ctl.engine)
    assert [v.name for v in ctl.list_vms()] == ["serve"]
    queue = ctl.scheduling.queue()
    assert [(q["tenant"], q["name"], q["requeued"], q["vm_id"], q["priority_class"]) for q in queue] == \
        [("acme", "train", True, low.id, "batch")]
    events = ctl.events()
    pre = next(e for e in events if e["action"] == "vm.preempt")
    assert pre["params"]["preemptor"] == {"tenant": "beta", "name": "serve", "priority_class": "prod",
                                          "priority": 1000}
    assert [v["name"] for v in pre["params"]["victims"]] == ["train"] and pre["params"]["reason"] == "capacity"
    assert next(e for e in events if e["action"] == "vm.preempted")["params"]["mode"] == "requeue"
    assert ctl.scheduling.preemption_counts() == {("capacity", "requeue"): 1}
    # capacity frees: the victim comes back with its id (and so its disk), its class, and a cool-down
    ctl.release_vm("beta/serve")
    back = ctl.get_vm("acme/train")
    assert back.id == low.id and back.state == "running"
    assert ctl.scheduling.queue() == []
    row = sched_row(ctl, "train")
    assert (row["class_name"], row["priority"], row["preemptions"], row["protected_below"]) == ("batch", 10, 1, 1000)
    ops = ctl.list_operations(["succeeded"])
    assert ops[0].vm_id == low.id and ops[0].result is not None
    check_store_invariants(ctl.engine)


def test_cool_down_stops_equal_requests_not_higher(ctl: Controller) -> None:
    classes(ctl)
    whole(ctl, "acme", "train", priority="batch")
    whole(ctl, "beta", "serve", priority="prod")
    ctl.release_vm("beta/serve")  # train is back, protected from prod-level requests for the cool-down
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity, match="preempting does not help"):
        whole(ctl, "beta", "again", priority="prod")
    assert_unchanged_but_refusal(ctl, before)
    assert whole(ctl, "beta", "first", priority="urgent").state == "running"
    assert sched_row(ctl, "first")["priority"] == 5000


def test_dry_run_shows_victims_and_changes_nothing(ctl: Controller) -> None:
    classes(ctl)
    low = whole(ctl, "acme", "train", priority="batch")
    before = store_snapshot(ctl)
    plan = ctl.scheduling.preview("beta", "serve", [(WHOLE, 1)], vcpus=4, memory_mib=8192, pool="training",
                                  priority="prod")
    assert plan.to_dict() | {} == {
        "priority_class": "prod", "priority": 1000, "pool": "training", "host": "kvm-a100-01", "reason": "capacity",
        "victims": [{"vm_id": low.id, "tenant": "acme", "name": "train", "host": "kvm-a100-01",
                     "priority_class": "batch", "priority": 10, "mode": "requeue",
                     "devices": ["A100-80GB@0000:c1:00.0+0"]}]}
    assert store_snapshot(ctl) == before


def test_never_equal_or_non_preemptible(ctl: Controller) -> None:
    classes(ctl)
    whole(ctl, "acme", "p", priority="prod")  # not preemptible
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity) as err:
        whole(ctl, "beta", "u", priority="urgent")
    assert err.value.reasons[-1]["kind"] == "preemption"
    assert_unchanged_but_refusal(ctl, before)
    ctl.release_vm("acme/p")
    whole(ctl, "acme", "s", priority="std")
    before = store_snapshot(ctl)
    with pytest.raises(NoCapacity):
        whole(ctl, "beta", "s2", priority="std")  # equal priority never preempts
    assert_unchanged_but_refusal(ctl, before)
    with pytest.raises(NoCapacity):
        whole(ctl, "beta", "s3", priority="urgent", preempt=False)  # asked not to
    assert [v.name for v in ctl.list_vms()] == ["s"]


def test_cancel_mode_deletes_the_victim(ctl: Controller) -> None:
    classes(ctl)
    whole(ctl, "acme", "tmp", priority="scratch")
    whole(ctl, "beta", "serve", priority="prod")
    assert [v.name for v in ctl.list_vms()] == ["serve"]
    assert ctl.scheduling.queue() == []
    assert ctl.scheduling.preemption_counts() == {("capacity", "cancel"): 1}
    check_store_invariants(ctl.engine)


def test_mig_victims_by_start(ctl: Controller) -> None:
    # the inference pool's two free-carving H100s: four 3g.40gb batch VMs fill them; a 7g.80gb takes the two
    # newest on one GPU, not one from each
    classes(ctl)
    vms = [ctl.request_vm("acme", f"m{i}", "3g.40gb", vcpus=2, memory_mib=4096, pool="inference",
                          priority="batch") for i in range(4)]
    big = ctl.request_vm("beta", "big", "7g.80gb", vcpus=2, memory_mib=4096, pool="inference", priority="prod")
    gone = {q["name"] for q in ctl.scheduling.queue()}
    assert len(gone) == 2
    gpus = {v.devices[0].gpu for v in vms if v.name in gone}
    assert gpus == {big.devices[0].gpu}
    check_store_invariants(ctl.engine)


class _StubbornDriver:
    """A host whose guest ignores the ACPI shutdown: only a forced stop ends it."""

    def __init__(self) -> None:
        self.calls: list[bool] = []
        self.active = True

    def stop_domain(self, name: str, force: bool = False) -> None:
        self.calls.append(force)
        if force:
            self.active = False

    def list_domains(self) -> list[Any]:
        from vgpu_ctl.hosts.protocol import DomainInfo
        return [DomainInfo("d", "u", self.active)]


class _Hosts:
    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def get(self, host: Any) -> Any:
        return self.driver


class _Ctl:
    def __init__(self, driver: Any) -> None:
        self.hosts = _Hosts(driver)


def test_grace_then_force() -> None:
    driver = _StubbornDriver()
    assert scheduling.grace_stop(_Ctl(driver), None, "d", 0.05) is True  # type: ignore[arg-type]
    assert driver.calls == [False, True]
    polite = _StubbornDriver()
    polite.stop_domain = lambda name, force=False: setattr(polite, "active", False)  # type: ignore[method-assign]
    assert scheduling.grace_stop(_Ctl(polite), None, "d", 5) is False  # type: ignore[arg-type]


def test_cli_preempt_dry_run_and_queue(cli: Cli) -> None:
    cli.json("tenant", "create", "beta")
    cli.json("priority", "create", "batch", "--value", "10", "--preemptible")
    cli.json("priority", "create", "prod", "--value", "1000", "--preemption-policy", "never")
    args = ["--profile", WHOLE, "--vcpus", "4", "--memory", "8GiB", "--pool", "training"]
    low = cli.json("vm", "create", "--tenant", "acme", "--name", "train", "--priority", "batch", *args)
    plan = cli.json("vm", "create", "--tenant", "beta", "--name", "serve", "--priority", "prod", "--preempt",
                    "--dry-run", *args)
    assert [v["vm_id"] for v in plan["victims"]] == [low["id"]]
    # prod never preempts: with --queue it waits instead, with the reason
    op = cli.json("vm", "create", "--tenant", "beta", "--name", "serve", "--priority", "prod", "--queue", *args)
    assert op["state"] == "pending" and op["error"]["code"] == "no_capacity"
    queue = cli.json("queue")
    assert [(q["name"], q["position"], q["priority"]) for q in queue] == [("serve", 1, 1000)]
    assert "no host can take VM 'serve'" in queue[0]["reason"]
    cli.json("vm", "delete", "acme/train")  # capacity frees: the queued request is admitted
    assert cli.json("queue") == []
    assert [(v["name"], v["state"]) for v in cli.json("vm", "list")] == [("serve", "running")]
    assert any(e["action"] == "vm.admit" for e in cli.json("events"))


def test_queue_cancel(cli: Cli) -> None:
    args = ["--profile", WHOLE, "--vcpus", "4", "--memory", "8GiB", "--pool", "training"]
    cli.json("vm", "create", "--tenant", "acme", "--name", "a", *args)
    op = cli.json("vm", "create", "--tenant", "acme", "--name", "b", "--queue", *args)
    out = cli.json("queue", "--cancel", op["id"])
    assert out["queue"] == []
    assert cli.json("queue", "--cancel", op["id"], code=4)["error"]["code"] == "not_found"


_OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(["acme", "beta"]), st.sampled_from(["batch", "std", "prod", "urgent"]),
              st.sampled_from(["3g.40gb", "7g.80gb", "1g.10gb"]), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 20)),
), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_OPS)
def test_invariants_after_any_sequence(state_dir: Path, ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp, Controller(f"sqlite:///{tmp}/s.db") as ctl:
        ctl.apply_inventory(DEMO)
        classes(ctl)
        for n, op in enumerate(ops):
            if op[0] == "admit":
                _, tenant, cls, profile, queue = op
                try:
                    ctl.request_vm(tenant, f"v{n}", profile, vcpus=2, memory_mib=4096, pool="inference",
                                   priority=cls, queue=queue)
                except Refused:
                    # refused: then no allowed set of victims makes room (a higher priority never waits while
                    # a lower preemptible VM holds what it needs)
                    with pytest.raises(NoCapacity):
                        ctl.scheduling.preview(tenant, f"v{n}", [(profile, 1)], vcpus=2, memory_mib=4096,
                                               pool="inference", priority=cls)
            else:
                vms = ctl.list_vms()
                if vms:
                    ctl.release_vm(vms[op[1] % len(vms)].id)
            check_store_invariants(ctl.engine)
            ctl.scheduling.admit()  # what waits and could preempt has done so: none waits needlessly now
            for q in ctl.scheduling.queue():
                vgpus = [(v["profile"], v["count"]) for v in next(
                    o for o in ctl.list_operations(["pending"]) if o.id == q["operation"]).request["vgpus"]]
                with pytest.raises(NoCapacity):
                    ctl.scheduling.preview(q["tenant"], q["name"], vgpus, vcpus=2, memory_mib=4096, pool="inference",
                                           priority=q["priority_class"])
            check_store_invariants(ctl.engine)
            with ctl.engine.connect() as conn:  # every VM that holds devices has its priority row, and only those
                held = conn.execute(text("SELECT count(*) FROM vm WHERE state <> 'failed'")).scalar()
                rows = conn.execute(text("SELECT count(*) FROM vm_sched")).scalar()
            assert held == rows


def test_a_victim_that_cannot_be_freed_stays_and_is_not_requeued(ctl: Controller,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl.errors import Conflict
    from vgpu_ctl.service import provision
    classes(ctl)
    whole(ctl, "acme", "train", priority="batch")

    def busy(*args: Any, **kw: Any) -> None:
        raise Conflict("VM 'train' is being worked on by another process")

    monkeypatch.setattr(provision, "release_vm", busy)
    with pytest.raises(NoCapacity):
        whole(ctl, "beta", "serve", priority="prod")
    assert [v.name for v in ctl.list_vms()] == ["train"]
    assert ctl.scheduling.queue() == []
    failed = [e for e in ctl.events() if e["action"] == "vm.preempted"]
    assert [(e["result"], e["error"]) for e in failed] == [("failed", "VM 'train' is being worked on by another "
                                                                       "process")]
    assert ctl.scheduling.preemption_counts() == {}  # only preemptions that happened count
    check_store_invariants(ctl.engine)


def test_a_requeued_victim_still_there_is_dropped_after_the_grace(ctl: Controller,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl.service import provision
    classes(ctl)
    whole(ctl, "acme", "train", priority="batch")

    def die(*_args: Any, **_kw: Any) -> None:
        raise SystemExit("the preempting process died")

    with monkeypatch.context() as m:  # the preemption queues the victim's request, then dies before releasing it
        m.setattr(provision, "release_vm", die)
        with pytest.raises(SystemExit):
            whole(ctl, "beta", "serve", priority="prod")
    assert [(q["name"], q["requeued"]) for q in ctl.scheduling.queue()] == [("train", True)]
    ctl.scheduling.admit()
    assert len(ctl.scheduling.queue()) == 1  # young: its preemption may still be running
    ctl.scheduling.set_settings(grace_s=0)
    monkeypatch.setattr(scheduling, "PREEMPTION_SLACK_S", 0)
    ctl.scheduling.admit()
    assert ctl.scheduling.queue() == []
    assert ctl.get_vm("acme/train").state == "running"


def test_cool_down_runs_from_readmission_and_can_be_off(ctl: Controller) -> None:
    classes(ctl)
    ctl.scheduling.set_settings(cooldown_s=0)
    whole(ctl, "acme", "train", priority="batch")
    whole(ctl, "beta", "serve", priority="prod")
    ctl.release_vm("beta/serve")
    row = sched_row(ctl, "train")
    assert row["protected_until"] == pytest.approx(row["admitted_at"])  # from its re-admission, 0 s long
    assert whole(ctl, "beta", "again", priority="prod").state == "running"  # no cool-down: preempted again
    assert [q["name"] for q in ctl.scheduling.queue()] == ["train"]


def test_tenants_see_their_side_only(ctl: Controller) -> None:
    classes(ctl)
    low = whole(ctl, "acme", "train", priority="batch")
    url = ctl.engine.url.render_as_string(hide_password=False)
    beta_token, acme_token = ctl.issue_token("beta"), ctl.issue_token("acme")
    with Controller(url, token=beta_token, state_path=ctl.state_path) as beta:
        plan = beta.scheduling.preview("beta", "serve", [(WHOLE, 1)], vcpus=4, memory_mib=8192, pool="training",
                                       priority="prod")
        (v,) = plan.victims
        assert (v.vm_id, v.tenant, v.name, v.devices, v.priority) == ("", "(another tenant)", "", (), 10)
        assert low.id not in str(plan.to_dict())
        whole(beta, "beta", "serve", priority="prod")
        leaks = [e for e in beta.events() if low.id in str(e) or "'train'" in str(e)]
        assert leaks == []  # the preemptor does not learn whom it preempted
    with Controller(url, token=acme_token, state_path=ctl.state_path) as acme:
        (mine,) = [e for e in acme.events() if e["action"] == "vm.preempted"]
        assert mine["params"]["preemptor_priority"] == 1000 and "serve" not in str(mine)
        assert [q["name"] for q in acme.scheduling.queue()] == ["train"]
    assert any(e["action"] == "vm.preempt" for e in ctl.events())  # the admin sees the whole story
