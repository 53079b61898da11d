"""Tenant isolation through the CLI: another tenant's objects are "not found" (4), admin commands are
refused (7), wrong or revoked tokens are refused (7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opsfixtures import DEMO, Store, cli, clone, events_of, template_store

from vgpu_ctl import NotFound


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _g1_id(store: Store) -> str:
    return str(store.sql("SELECT id FROM vm WHERE name = 'g1'")[0][0])


@pytest.mark.parametrize("how", ["option", "env"])
@pytest.mark.parametrize("command", [["vm", "show"], ["vm", "delete"], ["vm", "start"], ["vm", "stop"],
                                     ["vm", "xml"]])
def test_other_tenants_vm_is_not_found(store: Store, command: list[str], how: str) -> None:
    token = store.tokens["acme"]
    gid = _g1_id(store)
    for ref in (gid, "g1", "globex/g1"):
        res = cli(store, *command, ref, token=token if how == "option" else None,
                  env_token=token if how == "env" else None)
        assert res.exit_code == 4, (command, ref, res.output)
        assert "not found" in res.output
        if ref != gid:
            assert gid not in res.output
    assert store.sql("SELECT state FROM vm WHERE name = 'g1'") == [("running",)]


def test_own_vm_is_visible(store: Store) -> None:
    res = cli(store, "vm", "show", "a1", "--json", token=store.tokens["acme"])
    assert res.exit_code == 0 and json.loads(res.stdout)["tenant"] == "acme"


def test_lists_show_only_own_objects(store: Store) -> None:
    token = store.tokens["acme"]
    vms = json.loads(cli(store, "vm", "list", "--json", token=token).stdout)
    assert {v["tenant"] for v in vms} == {"acme"}
    assert cli(store, "vm", "list", "--tenant", "globex", token=token).exit_code == 4
    assert cli(store, "tenant", "usage", "globex", token=token).exit_code == 4
    assert cli(store, "tenant", "usage", "acme", token=token).exit_code == 0
    assert cli(store, "events", "--tenant", "globex", token=token).exit_code == 4
    events = json.loads(cli(store, "events", "--json", token=token).stdout)
    assert events and {e["tenant"] for e in events} == {"acme"}
    assert "globex" not in json.dumps(events) and _g1_id(store) not in json.dumps(events)
    status = cli(store, "status", "--json", token=token)
    assert status.exit_code == 0 and "globex" not in status.stdout and _g1_id(store) not in status.stdout


def test_tenant_cannot_create_vms_for_another(store: Store) -> None:
    before = len(events_of(store))
    res = cli(store, "vm", "create", "--tenant", "globex", "--name", "sneaky", "--profile", "L40S-4C",
              "--vcpus", "1", "--memory", "1GiB", token=store.tokens["acme"])
    assert res.exit_code == 4
    ctl = store.as_tenant("acme")
    try:
        with pytest.raises(NotFound):
            ctl.request_vm("globex", "sneaky2", "L40S-4C", vcpus=1, memory_mib=1024)
    finally:
        ctl.close()
    assert store.sql("SELECT count(*) FROM vm WHERE name LIKE 'sneaky%'") == [(0,)]
    assert len(events_of(store)) == before


@pytest.mark.parametrize("command", [
    ["inventory", "apply", str(DEMO)],
    ["quota", "set", "acme", "--vms", "100"],
    ["tenant", "create", "evil"],
    ["tenant", "delete", "globex"],
    ["tenant", "token", "globex"],
    ["tenant", "token", "globex", "--revoke"],
    ["metrics", "dump"],
    ["metrics", "sample"],
    ["doctor"],
    ["db", "backup", "/tmp/vgpuctl-isolation-backup.db"],
])
def test_admin_commands_are_refused(store: Store, command: list[str]) -> None:
    before = len(events_of(store))
    res = cli(store, *command, token=store.tokens["acme"])
    assert res.exit_code == 7, res.output
    assert "admin" in res.output
    assert len(events_of(store)) == before
    assert not Path("/tmp/vgpuctl-isolation-backup.db").exists()


def test_restore_is_refused_to_tenants(store: Store, tmp_path: Path) -> None:
    file = tmp_path / "b.db"
    assert cli(store, "db", "backup", str(file)).exit_code == 0
    assert cli(store, "db", "restore", str(file), "--yes", token=store.tokens["acme"]).exit_code == 7


def test_wrong_and_revoked_tokens_are_refused(store: Store) -> None:
    res = cli(store, "vm", "list", token="vgt_not-a-token")
    assert res.exit_code == 7 and "not valid" in res.output
    assert cli(store, "vm", "list", env_token="vgt_not-a-token").exit_code == 7
    old = store.tokens["acme"]
    assert cli(store, "tenant", "token", "acme", "--revoke").exit_code == 0
    assert cli(store, "vm", "list", token=old).exit_code == 7
    assert cli(store, "status", token=old).exit_code == 7
    new = cli(store, "tenant", "token", "acme", "--json")
    token = json.loads(new.stdout)["token"]
    assert cli(store, "vm", "list", token=token).exit_code == 0
    assert cli(store, "vm", "list", token=old).exit_code == 7
