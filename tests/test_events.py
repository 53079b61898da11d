"""The audit trail: each change records one event with who, what, which, how; refusals are recorded and
change nothing else; `vgpuctl events` filters by tenant and time."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opsfixtures import DEMO, Store, cli, clone, events_of, snapshot, template_store

from vgpu_ctl import Controller, InvalidInput, NoCapacity, QuotaExceeded
from vgpu_ctl.ops.events import parse_since


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _new_events(store: Store, fn: Callable[[Controller], Any], actor: str | None = "alice",
                token: str | None = None) -> list[dict[str, Any]]:
    before = len(events_of(store))
    ctl = store.ctl(token=token, actor=actor)
    try:
        fn(ctl)
    finally:
        ctl.close()
    return events_of(store)[before:]


@pytest.mark.parametrize(("action", "fn", "target", "tenant", "params"), [
    ("tenant.create", lambda c: c.create_tenant("initech"), "initech", "initech", {}),
    ("tenant.token", lambda c: c.issue_token("acme"), "acme", "acme", {}),
    ("tenant.token.revoke", lambda c: c.revoke_token("acme"), "acme", "acme", {}),
    ("quota.set", lambda c: c.set_quota("acme", {"vms": 9}, pool="inference"), "acme", "acme",
     {"pool": "inference", "limits": {"vms": 9}}),
    ("tenant.delete", lambda c: (c.create_tenant("tmp"), c.delete_tenant("tmp")), "tmp", "tmp", {}),
])
def test_admin_change_records_one_event(store: Store, action: str, fn: Callable[[Controller], Any],
                                        target: str, tenant: str, params: dict[str, Any]) -> None:
    new = [e for e in _new_events(store, fn) if e["action"] == action]
    assert len(new) == 1
    [e] = new
    assert (e["actor"], e["tenant"], e["target"], e["result"], e["error"]) == ("alice", tenant, target, "ok", None)
    for k, v in params.items():
        assert e["params"][k] == v


def test_inventory_apply_records_one_event_only_when_something_changed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path))
    ctl = Controller(f"sqlite:///{tmp_path / 's.db'}", actor="alice", state_path=tmp_path)
    try:
        ctl.apply_inventory(DEMO)
        [e] = ctl.events()
        assert (e["action"], e["actor"], e["target"], e["result"]) == ("inventory.apply", "alice", str(DEMO), "ok")
        assert e["params"]["changes"] > 0
        ctl.apply_inventory(DEMO)
        ctl.apply_inventory(DEMO, dry_run=True)
        assert len(ctl.events()) == 1
    finally:
        ctl.close()


def test_vm_lifecycle_records_one_event_per_change(store: Store) -> None:
    token = store.tokens["globex"]
    new = _new_events(store, lambda c: c.request_vm("globex", "g9", "L40S-4C", vcpus=1, memory_mib=1024),
                      token=token, actor=None)
    assert [e["action"] for e in new] == ["vm.create", "vm.start"]  # claim, then provisioned and started
    create = new[0]
    assert create["actor"] == "tenant:globex" and create["tenant"] == "globex" and create["result"] == "ok"
    vm_id = create["target"].removeprefix("vm:")
    assert create["params"]["name"] == "g9" and create["params"]["devices"][0]["profile"] == "L40S-4C"
    for fn, action in ((lambda c: c.stop_vm("globex/g9"), "vm.stop"), (lambda c: c.start_vm(vm_id), "vm.start"),
                       (lambda c: c.release_vm("globex/g9"), "vm.delete")):
        [e] = _new_events(store, fn)
        assert (e["action"], e["actor"], e["tenant"], e["target"], e["result"]) == \
            (action, "alice", "globex", f"vm:{vm_id}", "ok")
        assert e["params"]["name"] == "g9"


def test_provisioning_start_event_names_the_tenant(store: Store) -> None:
    new = _new_events(store, lambda c: c.request_vm("globex", "g8", "L40S-4C", vcpus=1, memory_mib=1024))
    assert [e["tenant"] for e in new] == ["globex", "globex"]


def test_quota_refusal_is_recorded_and_changes_nothing_else(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("acme", {"vgpus": 2})
    finally:
        ctl.close()
    before = snapshot(store)
    def go(c: Controller) -> None:
        with pytest.raises(QuotaExceeded):
            c.request_vm("acme", "big", "1g.10gb", vcpus=1, memory_mib=1024)

    new = _new_events(store, go)
    assert snapshot(store) == before
    [e] = new
    assert (e["action"], e["actor"], e["tenant"], e["target"], e["result"], e["error"]) == \
        ("vm.create", "alice", "acme", "vm:acme/big", "refused", "quota_exceeded")
    assert e["params"]["profiles"] == ["1g.10gb"] and "over quota" in e["params"]["message"]


def test_capacity_refusal_is_recorded_and_changes_nothing_else(store: Store) -> None:
    before = snapshot(store)
    def go(c: Controller) -> None:
        with pytest.raises(NoCapacity):
            c.request_vm("acme", "huge", "L40S-48C", vcpus=100000, memory_mib=1024)

    new = _new_events(store, go)
    assert snapshot(store) == before
    [e] = new
    assert (e["result"], e["error"], e["tenant"]) == ("refused", "no_capacity", "acme")


def test_invalid_requests_and_dry_runs_record_nothing(store: Store) -> None:
    before = snapshot(store)
    def go(c: Controller) -> None:
        with pytest.raises(InvalidInput):
            c.request_vm("acme", "x", "NO-SUCH", vcpus=1, memory_mib=1)
        with pytest.raises(NoCapacity):
            c.request_vm("acme", "y", "L40S-48C", vcpus=100000, memory_mib=1, dry_run=True)

    new = _new_events(store, go)
    assert new == [] and snapshot(store) == before


def test_parse_since() -> None:
    now = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("1h", now) == now - timedelta(hours=1)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2025-05-31T10:00", now) == datetime(2025, 5, 31, 10, 0, tzinfo=UTC)
    assert parse_since("2025-05-31T12:00+02:00", now) == datetime(2025, 5, 31, 10, 0, tzinfo=UTC)
    assert parse_since("2025-05-31", now) == datetime(2025, 5, 31, tzinfo=UTC)
    with pytest.raises(InvalidInput):
        parse_since("yesterday", now)


def test_events_command_filters(store: Store) -> None:
    everything = json.loads(cli(store, "events", "--json").stdout)
    assert len(everything) == len(events_of(store))
    acme = json.loads(cli(store, "events", "--tenant", "acme", "--json").stdout)
    assert acme and {e["tenant"] for e in acme} == {"acme"}
    assert json.loads(cli(store, "events", "--since", "1h", "--json").stdout) == everything
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert json.loads(cli(store, "events", "--since", future, "--json").stdout) == []
    assert cli(store, "events", "--since", "soon").exit_code == 2
    text = cli(store, "events")
    assert text.exit_code == 0 and "vm.create" in text.output and "\x1b[" not in text.output
