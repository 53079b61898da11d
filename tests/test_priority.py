"""Priority classes: the rules (core.priority), the store's invariants (CHECKs, foreign keys, one global
default), the CLI (create, list, delete, tenant limits, bad input exit 2 with nothing changed) and the class a
VM request gets and keeps."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Cli, store_snapshot
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from vgpu_ctl import Controller, InvalidInput
from vgpu_ctl.core.priority import NO_CLASS, PriorityClass, may_preempt, resolve_class
from vgpu_ctl.errors import Conflict, PermissionDenied

CLASSES = {"low": PriorityClass("low", 10, preemptible=True), "std": PriorityClass("std", 100, default=True),
           "high": PriorityClass("high", 1000)}


def test_resolve_named_tenant_default_global_default() -> None:
    assert resolve_class("high", CLASSES, None, None).name == "high"
    assert resolve_class(None, CLASSES, None, "low").name == "low"
    assert resolve_class(None, CLASSES, None, None).name == "std"
    assert resolve_class(None, {}, None, None) is NO_CLASS
    # limited to some classes without the global default among them: the lowest allowed
    assert resolve_class(None, CLASSES, ["low", "high"], None).name == "low"


def test_resolve_refuses_unknown_and_disallowed() -> None:
    with pytest.raises(InvalidInput, match=r"unknown priority class 'urgent'.*field priority"):
        resolve_class("urgent", CLASSES, None, None)
    with pytest.raises(InvalidInput, match="may not use priority class 'high'") as err:
        resolve_class("high", CLASSES, ["low"], None, "acme")
    assert err.value.reasons[0]["field"] == "priority"


def test_may_preempt_only_lower_and_preemptible() -> None:
    assert may_preempt(100, 10, True)
    assert not may_preempt(100, 10, False)
    assert not may_preempt(100, 100, True)
    assert not may_preempt(10, 100, True)
    assert not may_preempt(100, 10, True, protected_below=100)
    assert may_preempt(101, 10, True, protected_below=100)


def test_cli_create_list_delete(cli: Cli) -> None:
    out = cli.json("priority", "create", "batch", "--value", "10", "--preemptible", "--preemption-mode", "cancel")
    assert out == {"name": "batch", "value": 10, "preemptible": True, "preemption_policy": "lower-priority",
                   "preemption_mode": "cancel", "default": False, "description": "", "vms": 0}
    cli.json("priority", "create", "std", "--value", "100", "--default", "--preemption-policy", "never")
    cli.json("priority", "create", "prod", "--value", "1000", "--default")  # takes over the default
    rows = cli.json("priority", "list")
    assert [(r["name"], r["default"]) for r in rows] == [("prod", True), ("std", False), ("batch", False)]
    assert cli.json("priority", "delete", "std") == {"deleted": "std"}
    assert [r["name"] for r in cli.json("priority", "list")] == ["prod", "batch"]


@pytest.mark.parametrize("args,field", [
    (["--value", "-1"], "value"),
    (["--value", "1000000001"], "value"),
    (["--value", "5", "--preemption-policy", "sometimes"], "preemption_policy"),
    (["--value", "5", "--preemption-mode", "pause"], "preemption_mode"),  # pausing frees nothing: no mode
])
def test_cli_bad_class_exit_2_nothing_changed(cli: Cli, args: list[str], field: str) -> None:
    before = cli.json("priority", "list")
    out = cli.json("priority", "create", "x", *args, code=2)
    assert out["error"]["code"] == "invalid" and out["error"]["reasons"][0]["field"] == field
    assert field in out["error"]["message"]
    assert cli.json("priority", "list") == before


def test_cli_bad_name_and_duplicate(cli: Cli) -> None:
    out = cli.json("priority", "create", "no spaces", "--value", "1", code=2)
    assert "priority class" in out["error"]["message"]
    cli.json("priority", "create", "a", "--value", "1")
    assert cli.json("priority", "create", "a", "--value", "2", code=5)["error"]["code"] == "conflict"
    assert cli.json("priority", "delete", "nope", code=4)["error"]["code"] == "not_found"


def test_tenant_limits_and_default(cli: Cli) -> None:
    cli.json("priority", "create", "batch", "--value", "10", "--preemptible")
    cli.json("priority", "create", "prod", "--value", "1000")
    out = cli.json("tenant", "set", "acme", "--priority-classes", "batch", "--default-priority", "batch",
                   "--shares", "4")
    assert out == {"tenant": "acme", "shares": 4, "account": None, "default_priority": "batch",
                   "priority_classes": ["batch"]}
    # a default outside the allowed classes, unknown classes: exit 2, nothing changed
    bad = cli.json("tenant", "set", "acme", "--default-priority", "prod", code=2)
    assert bad["error"]["reasons"][0]["field"] == "default_priority"
    bad = cli.json("tenant", "set", "acme", "--priority-classes", "batch,gold", code=2)
    assert "'gold'" in bad["error"]["message"] and bad["error"]["reasons"][0]["field"] == "priority_classes"
    assert cli.json("tenant", "set", "acme", "--shares", "0", code=2)["error"]["reasons"][0]["field"] == "shares"
    vm = cli.json("vm", "create", "--tenant", "acme", "--name", "a", "--profile", "1g.10gb", "--vcpus", "2",
                  "--memory", "4GiB")
    assert vm["state"] == "running"
    assert cli.json("priority", "list")[1] | {} == {"name": "batch", "value": 10, "preemptible": True,
                                                    "preemption_policy": "lower-priority",
                                                    "preemption_mode": "requeue", "default": False,
                                                    "description": "", "vms": 1}
    # a class the tenant may not use: exit 2, no VM
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "b", "--profile", "1g.10gb", "--vcpus", "2",
                   "--memory", "4GiB", "--priority", "prod", code=2)
    assert out["error"]["reasons"][0]["field"] == "priority"
    assert [v["name"] for v in cli.json("vm", "list")] == ["a"]
    # a class in use can't go
    assert cli.json("priority", "delete", "batch", code=5)["error"]["code"] == "conflict"


def _vm_sched(ctl: Controller) -> list[dict[str, Any]]:
    with ctl.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text(
            "SELECT v.name, s.class_name, s.priority, s.preemptible, s.fb_gib, s.compute_slices "
            "FROM vm_sched s JOIN vm v ON v.id = s.vm_id ORDER BY v.name"))]


def test_vm_keeps_its_class_and_value(ctl: Controller) -> None:
    s = ctl.scheduling
    ctl.create_tenant("acme")
    s.create_class("batch", 10, preemptible=True)
    ctl.request_vm("acme", "nodefault", "1g.10gb", vcpus=2, memory_mib=4096)
    s.create_class("std", 100, default=True)
    ctl.request_vm("acme", "default", "1g.10gb", vcpus=2, memory_mib=4096)
    ctl.request_vm("acme", "named", "A100-80GB", vcpus=2, memory_mib=4096, priority="batch")
    rows = {r["name"]: r for r in _vm_sched(ctl)}
    assert (rows["nodefault"]["class_name"], rows["nodefault"]["priority"]) == (None, 0)
    assert (rows["default"]["class_name"], rows["default"]["priority"]) == ("std", 100)
    assert (rows["named"]["class_name"], rows["named"]["priority"], bool(rows["named"]["preemptible"])) == \
        ("batch", 10, True)
    # what each is charged for fair share: a 1g slice is 1 compute slice and 10 GiB, a whole A100 7 and 80 GiB
    assert (rows["default"]["fb_gib"], rows["default"]["compute_slices"]) == (10.0, 1.0)
    assert (rows["named"]["fb_gib"], rows["named"]["compute_slices"]) == (80.0, 7.0)
    # changing the class later does not change the VMs: they keep the value they were admitted with
    with pytest.raises(Conflict):
        s.delete_class("batch")
    ctl.release_vm("acme/named")
    s.delete_class("batch")
    assert [r["name"] for r in _vm_sched(ctl)] == ["default", "nodefault"]


def test_bad_priority_changes_nothing(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.scheduling.create_class("std", 100)
    before = store_snapshot(ctl)
    with pytest.raises(InvalidInput, match="unknown priority class 'gold'"):
        ctl.request_vm("acme", "a", "1g.10gb", vcpus=2, memory_mib=4096, priority="gold")
    with pytest.raises(InvalidInput, match="unknown priority class 'gold'"):
        ctl.request_vm("acme", "a", "1g.10gb", vcpus=2, memory_mib=4096, priority="gold", dry_run=True)
    assert store_snapshot(ctl) == before


def test_store_enforces_one_default_and_ranges(ctl: Controller) -> None:
    s = ctl.scheduling
    s.create_class("a", 1, default=True)
    stmt = ("INSERT INTO priority_class (name, value, preemptible, preemption_policy, preemption_mode, is_default, "
            "description, created_at) VALUES (:n, :v, false, :p, 'requeue', :d, '', CURRENT_TIMESTAMP)")
    for params in ({"n": "b", "v": 2, "p": "never", "d": True},  # a second default
                   {"n": "c", "v": -1, "p": "never", "d": False},  # value out of range
                   {"n": "e", "v": 5, "p": "sometimes", "d": False}):  # unknown policy
        with pytest.raises(IntegrityError), ctl.engine.begin() as conn:
            conn.execute(text(stmt), params)
    assert [c["name"] for c in s.list_classes()] == ["a"]


def test_tenant_cannot_manage_classes(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    token = ctl.issue_token("acme")
    with Controller(ctl.engine.url.render_as_string(hide_password=False), token=token,
                    state_path=ctl.state_path) as tenant:
        with pytest.raises(PermissionDenied):
            tenant.scheduling.create_class("mine", 10**9)
        assert tenant.scheduling.list_classes() == []
