"""Issue 9's safety defects, one regression test (or a few) each: what hostile or unlucky use did, and what it
must do now. Bad input ends in InvalidInput naming the field, with nothing changed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import check_store_invariants, store_snapshot

from vgpu_ctl import Conflict, Controller


def req(ctl: Controller, name: str, profile: str = "A100D-10C", tenant: str = "acme", **kw: Any) -> Any:
    kw.setdefault("vcpus", 2)
    kw.setdefault("memory_mib", 4096)
    return ctl.request_vm(tenant, name, [(profile, 1)], **kw)


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def _domain_active(ctl: Controller, vm: Any) -> bool:
    with ctl.engine.connect() as conn:
        from sqlalchemy import select

        from vgpu_ctl.store import tables
        host = conn.execute(select(tables.HOST).where(tables.HOST.c.name == vm.host)).one()
    return next(d.active for d in ctl.hosts.get(host).list_domains() if d.uuid == vm.id)


# -- 2: idempotency keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [{"vcpus": 4}, {"memory_mib": 8192}, {"profile": "A100D-20C"},
                                    {"name": "other"}, {"pool": "training"}, {"labels": {"a": "b"}}])
def test_idempotency_key_reused_for_another_request_is_a_conflict(acme: Controller, change: dict[str, Any]) -> None:
    first = req(acme, "job1", pool="inference", idempotency_key="k-1")
    before = store_snapshot(acme)
    kw: dict[str, Any] = {"name": "job1", "profile": "A100D-10C", "pool": "inference", **change}
    with pytest.raises(Conflict, match="idempotency key 'k-1'") as err:
        req(acme, kw.pop("name"), kw.pop("profile"), idempotency_key="k-1", **kw)
    assert err.value.reasons[0]["field"] == "idempotency_key"
    assert store_snapshot(acme) == before
    assert req(acme, "job1", pool="inference", idempotency_key="k-1").id == first.id  # the same request still is


def test_resent_create_does_not_start_a_stopped_vm(acme: Controller) -> None:
    vm = req(acme, "job1", idempotency_key="k-1")
    acme.stop_vm(vm.id)
    again = req(acme, "job1", idempotency_key="k-1")
    assert again.id == vm.id and again.state == "stopped"
    assert not _domain_active(acme, vm)
    check_store_invariants(acme.engine)


# -- 11: in-flight VMs after a crash -----------------------------------------------------------------------


def test_reconcile_reports_a_vm_another_process_works_on_as_in_progress(acme: Controller) -> None:
    from vgpu_ctl.service.leases import expiry

    vm = req(acme, "job1", provision=False)
    with acme.tx() as conn:  # another live process (on another machine) is provisioning it
        from sqlalchemy import update

        from vgpu_ctl.store.tables import VM
        conn.execute(update(VM).where(VM.c.id == vm.id).values(lease_holder="elsewhere:1:abc",
                                                                lease_expires=expiry()))
    for fix in (False, True):
        report = acme.reconcile(fix=fix)
        assert not report.clean
        f = next(f for f in report.findings if f.target == f"vm:{vm.id}")
        assert f.kind == "in-progress" and not f.fixed
    assert acme.get_vm(vm.id).state == "placed"  # left to the process that holds it


def test_reconcile_finishes_an_abandoned_vm_at_once(acme: Controller) -> None:
    vm = req(acme, "job1", provision=False)  # claimed, then its process went away: no lease is held
    report = acme.reconcile(fix=False)
    assert not report.clean
    assert next(f for f in report.findings if f.target == f"vm:{vm.id}").kind == "stuck-claim"
    report = acme.reconcile(fix=True)
    assert report.clean, report.to_dict()
    assert acme.get_vm(vm.id).state == "failed"
    check_store_invariants(acme.engine)


def test_reconcile_finishes_a_vm_whose_holder_died(acme: Controller, state_dir: Path) -> None:
    import subprocess

    from sqlalchemy import update

    from vgpu_ctl.service.leases import expiry, new_holder
    from vgpu_ctl.store.tables import VM
    vm = req(acme, "job1")
    proc = subprocess.Popen(["true"])
    proc.wait()
    holder = new_holder().split(":")
    with acme.tx() as conn:  # a release was under way in a process of this machine that no longer runs
        conn.execute(update(VM).where(VM.c.id == vm.id).values(
            state="releasing", lease_holder=f"{holder[0]}:{proc.pid}:{holder[2]}", lease_expires=expiry()))
    report = acme.reconcile(fix=True)
    assert report.clean, report.to_dict()
    assert [v.name for v in acme.list_vms()] == []
    check_store_invariants(acme.engine)


# -- 7: tokens ---------------------------------------------------------------------------------------------


def test_empty_token_is_refused(acme: Controller, store_url: str) -> None:
    from vgpu_ctl import PermissionDenied
    with pytest.raises(PermissionDenied, match="token"):
        Controller(store_url, token="")


def _cli(url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    from typer.testing import CliRunner

    from vgpu_ctl.cli.main import app
    return CliRunner().invoke(app, ["--db", url, *args], env=env)


def test_empty_token_on_the_command_line_or_in_the_environment_is_refused(state_dir: Path,
                                                                          sqlite_url: str) -> None:
    c = Controller(sqlite_url)
    c.create_tenant("acme")
    before = store_snapshot(c)
    for args, env in ((["--token", "", "tenant", "create", "evil"], None),
                      (["tenant", "create", "evil"], {"VGPU_CTL_TOKEN": ""}),
                      (["--token", "", "tenant", "list", "--json"], None)):
        result = _cli(sqlite_url, *args, env=env)
        assert result.exit_code == 7, (args, env, result.output)
        assert "token" in result.output
    assert store_snapshot(c) == before
    c.close()


def test_a_tenant_token_may_not_run_init(state_dir: Path, sqlite_url: str) -> None:
    from vgpu_ctl import PermissionDenied
    c = Controller(sqlite_url)
    c.create_tenant("acme")
    token = c.issue_token("acme")
    before = store_snapshot(c)
    result = _cli(sqlite_url, "--token", token, "init")
    assert result.exit_code == 7, result.output
    t = Controller(sqlite_url, token=token)
    try:
        with pytest.raises(PermissionDenied, match="init"):
            t.init()
        assert t.principal.tenant == "acme"
    finally:
        t.close()
    assert store_snapshot(c) == before
    c.close()


# -- 3: inventory URIs -------------------------------------------------------------------------------------

BAD_URIS = [
    "qemu+ext:///system?command=/tmp/x.sh",
    "qemu+ssh://root@h;touch /tmp/p/system",
    "qemu+ssh://root@h/system?netcat=nc|sh",
    "qemu+ssh://root@h/system?keyfile=$(id)",
    "qemu+ssh://root@h/system?keyfile=`id`",
    "qemu+ssh://root@h/system?command=/bin/sh",
    "qemu+ssh://root@h/system?socket=/tmp/x&netcat=/tmp/x",
    "qemu+ssh://root@h/system?no_verify=1",
    "qemu+ssh://root@h/system#frag",
    "qemu+ssh://-oProxyCommand=x/system",
    "qemu+ssh://root@h:22x/system",
    "qemu+tcp://h/system",
    "qemu+libssh2://h/system?known_hosts_verify=ignore",
    "qemu:///system\n",
    "qemu://h/../../etc",
    "xen:///system",
    "lxc:///",
    "test:///default?x=1",
    "simulated:///a;b",
]
GOOD_URIS = [
    "qemu:///system", "qemu:///session", "qemu+ssh://root@kvm1/system", "qemu+ssh://kvm1.example.com:2222/system",
    "qemu+ssh://root@10.0.0.5/system?keyfile=/root/.ssh/id_ed25519&known_hosts=/etc/vgpu/known_hosts",
    "qemu+tls://kvm1/system?pkipath=/etc/pki/vgpu", "qemu+ssh://root@[fd00::5]/system", "qemu+unix:///system",
    "qemu+libssh2://root@kvm1/system?sshauth=privkey&known_hosts=/etc/vgpu/known_hosts", "test:///default",
    "test:///var/lib/vgpu/node.xml", "simulated:///kvm-a100-01",
]


def _host_yaml(uri: str) -> str:
    import json
    return (f"hosts:\n  - name: h1\n    uri: {json.dumps(uri)}\n    driver: libvirt\n"
            "    vcpus: 8\n    memory_mib: 8192\n")


@pytest.mark.parametrize("uri", BAD_URIS)
def test_inventory_uri_outside_the_allowed_transports_and_keys_is_refused(tmp_path: Path, uri: str) -> None:
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.errors import InventoryError
    from vgpu_ctl.inventory import parse_inventory
    path = tmp_path / "inv.yaml"
    path.write_text(_host_yaml(uri))
    with pytest.raises(InventoryError, match=r"field hosts\[0\]\.uri") as err:
        parse_inventory(path, load_catalog())
    assert err.value.exit_code == 2


@pytest.mark.parametrize("uri", GOOD_URIS)
def test_inventory_uri_a_controller_needs_is_accepted(tmp_path: Path, uri: str) -> None:
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.inventory import parse_inventory
    path = tmp_path / "inv.yaml"
    path.write_text(_host_yaml(uri))
    assert parse_inventory(path, load_catalog()).hosts[0].uri == uri


def test_inventory_apply_with_a_command_uri_changes_nothing(state_dir: Path, sqlite_url: str, tmp_path: Path) -> None:
    c = Controller(sqlite_url)
    before = store_snapshot(c)
    path = tmp_path / "inv.yaml"
    path.write_text(_host_yaml(BAD_URIS[0]))
    result = _cli(sqlite_url, "inventory", "apply", str(path))
    assert result.exit_code == 2 and "uri" in result.output
    assert store_snapshot(c) == before
    result = _cli(sqlite_url, "host", "discover", BAD_URIS[0])
    assert result.exit_code == 2 and "uri" in result.output, result.output
    c.close()


def test_a_stored_uri_from_before_the_check_is_not_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written before URIs were checked may hold a command URI: opening that host is a HostError and
    libvirt is never asked to open it."""
    from vgpu_ctl.errors import HostError
    from vgpu_ctl.hosts import nodedev
    opened: list[str] = []
    monkeypatch.setattr(nodedev.libvirt, "open", lambda uri: opened.append(uri))
    with pytest.raises(HostError, match="host kvm1: not opened") as err:
        nodedev.open_libvirt(BAD_URIS[0], "kvm1")
    assert err.value.reasons[0]["field"] == "uri" and opened == []


# -- 6: names with a trailing newline ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t-alpha\n", "t-alpha\r\n", "\nt-alpha"])
def test_tenant_name_with_a_newline_is_refused(acme: Controller, name: str) -> None:
    from vgpu_ctl import InvalidInput
    acme.create_tenant("t-alpha")
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match="tenant") as err:
        acme.create_tenant(name)
    assert err.value.reasons[0] == {"field": "tenant", "value": name}
    assert store_snapshot(acme) == before


def test_cli_tenant_name_with_a_newline_exits_2(state_dir: Path, sqlite_url: str) -> None:
    Controller(sqlite_url).close()
    assert _cli(sqlite_url, "tenant", "create", "t-alpha").exit_code == 0
    result = _cli(sqlite_url, "tenant", "create", "t-alpha\n")
    assert result.exit_code == 2 and "tenant" in result.output


@pytest.mark.parametrize("field,text", [
    ("hosts[0].name", "hosts:\n  - {name: \"h1\\n\", uri: \"simulated:///h1\", driver: simulated, vcpus: 8, "
                      "memory_mib: 8192}\n"),
    ("pools[0].name", "pools:\n  - {name: \"p1\\n\"}\n"),
    ("hosts[0].gpus[0].pci", "hosts:\n  - {name: h1, uri: \"simulated:///h1\", driver: simulated, vcpus: 8, "
                             "memory_mib: 8192, gpus: [{pci: \"0000:41:00.0\\n\", model: A100-80GB}]}\n"),
])
def test_inventory_names_with_a_newline_are_refused(tmp_path: Path, field: str, text: str) -> None:
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.errors import InventoryError
    from vgpu_ctl.inventory import parse_inventory
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    with pytest.raises(InventoryError, match=f"field {re.escape(field)}"):
        parse_inventory(path, load_catalog())


def test_pci_address_with_a_newline_is_refused() -> None:
    from vgpu_ctl import InvalidInput
    from vgpu_ctl.render import PciAddress
    assert str(PciAddress.parse("0000:41:00.0")) == "0000:41:00.0"
    with pytest.raises(InvalidInput, match="PCI address"):
        PciAddress.parse("0000:41:00.0\n")


# -- 8: template names are checked before the claim --------------------------------------------------------


@pytest.mark.parametrize("template", ["nope.xml.j2", "../domain.xml.j2", "domain.txt", "domain.xml.j2\n"])
def test_bad_template_is_refused_before_the_claim(acme: Controller, template: str) -> None:
    from vgpu_ctl import InvalidInput
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match="template") as err:
        req(acme, "job1", template=template)
    assert err.value.reasons[0]["field"] == "template"
    assert store_snapshot(acme) == before  # no VM holding the name, no claim, no event
    assert req(acme, "job1").state == "running"  # the name is still free


def test_cli_bad_template_exits_2(state_dir: Path, sqlite_url: str) -> None:
    c = Controller(sqlite_url)
    from conftest import DEMO
    c.apply_inventory(DEMO)
    c.create_tenant("acme")
    before = store_snapshot(c)
    result = _cli(sqlite_url, "vm", "create", "--tenant", "acme", "--name", "job1", "--profile", "A100D-10C",
                  "--vcpus", "2", "--memory", "4GiB", "--template", "nope.xml.j2")
    assert result.exit_code == 2 and "template" in result.output, result.output
    assert store_snapshot(c) == before
    c.close()


# -- 9: huge numbers, booleans, hostile YAML ---------------------------------------------------------------


@pytest.mark.parametrize("field,kw", [
    ("vcpus", {"vcpus": 10**30}), ("memory_mib", {"memory_mib": 2**64}), ("vcpus", {"vcpus": True}),
    ("memory_mib", {"memory_mib": True}), ("vcpus", {"vcpus": 2.0}), ("vcpus", {"vcpus": 2**21}),
])
def test_huge_or_boolean_vm_sizes_are_input_errors(acme: Controller, field: str, kw: dict[str, Any]) -> None:
    from vgpu_ctl import InvalidInput
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match=field) as err:
        req(acme, "job1", **kw)
    assert err.value.reasons[0]["field"] == field
    assert store_snapshot(acme) == before


def test_boolean_vgpu_count_is_an_input_error(acme: Controller) -> None:
    from vgpu_ctl import InvalidInput
    before = store_snapshot(acme)
    with pytest.raises(InvalidInput, match="count"):
        acme.request_vm("acme", "job1", [("A100D-10C", True)], vcpus=2, memory_mib=4096)
    assert store_snapshot(acme) == before


@pytest.mark.parametrize("limits", [{"vgpus": 10**30}, {"framebuffer_mib": 2**63}, {"vms": True},
                                    {"profile:A100D-10C": 10**30}])
def test_huge_or_boolean_quota_limits_are_input_errors(acme: Controller, limits: dict[str, Any]) -> None:
    from vgpu_ctl import InvalidInput
    before = store_snapshot(acme)
    field = next(iter(limits))
    with pytest.raises(InvalidInput, match=re.escape(field)) as err:
        acme.set_quota("acme", limits)
    assert err.value.reasons[0]["field"] == field
    assert store_snapshot(acme) == before


def test_huge_event_limit_and_port_are_input_errors(acme: Controller) -> None:
    from vgpu_ctl import InvalidInput
    from vgpu_ctl.ops.events import list_events
    from vgpu_ctl.ops.metrics import serve
    for limit in (10**30, True, 0):
        with pytest.raises(InvalidInput, match="limit"):
            list_events(acme, limit=limit)
        with pytest.raises(InvalidInput, match="limit"):
            acme.events(limit=limit)
    for port in (99999, -1, True):
        with pytest.raises(InvalidInput, match="port"):
            serve(acme, port)


@pytest.mark.parametrize("args,field", [
    (["vm", "create", "--tenant", "acme", "--name", "j", "--profile", "A100D-10C", "--vcpus", str(10**30),
      "--memory", "4GiB"], "vcpus"),
    (["vm", "create", "--tenant", "acme", "--name", "j", "--profile", "A100D-10C", "--vcpus", "2",
      "--memory", f"{2**64}MiB"], "memory"),
    (["quota", "set", "acme", "--vgpus", str(10**30)], "vgpus"),
    (["events", "--limit", str(10**30)], "limit"),
    (["metrics", "serve", "--port", "99999"], "port"),
])
def test_cli_huge_numbers_exit_2(state_dir: Path, sqlite_url: str, args: list[str], field: str) -> None:
    c = Controller(sqlite_url)
    from conftest import DEMO
    c.apply_inventory(DEMO)
    c.create_tenant("acme")
    before = store_snapshot(c)
    result = _cli(sqlite_url, *args)
    assert result.exit_code == 2, result.output
    assert field in result.output and "Traceback" not in result.output
    assert store_snapshot(c) == before
    c.close()


@pytest.mark.parametrize("data,what", [
    (b"hosts: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested"),
    (b"hosts:\n  - name: h\xff1\n", "UTF-8"),
    (b"hosts:\n  - {name: h1, uri: 'simulated:///h1', driver: simulated, vcpus: true, memory_mib: 8192}\n",
     "hosts[0].vcpus"),
    (b"hosts:\n  - {name: h1, uri: 'simulated:///h1', driver: simulated, vcpus: 8, memory_mib: "
     + str(10**30).encode() + b"}\n", "hosts[0].memory_mib"),
    (b"hosts:\n  - {name: h1, uri: 'simulated:///h1', driver: simulated, vcpus: 8, memory_mib: 8, "
     b"cpu_overcommit: true}\n", "hosts[0].cpu_overcommit"),
    (b"pools:\n  - {name: p, demand: {1g.10gb: .inf}}\n", "weight"),
])
def test_hostile_inventory_yaml_is_an_input_error(tmp_path: Path, data: bytes, what: str) -> None:
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.errors import InventoryError
    from vgpu_ctl.inventory import parse_inventory
    path = tmp_path / "inv.yaml"
    path.write_bytes(data)
    with pytest.raises(InventoryError, match=re.escape(what)) as err:
        parse_inventory(path, load_catalog())
    assert err.value.exit_code == 2


def test_a_lease_is_renewed_while_its_holder_works(acme: Controller) -> None:
    import time

    from sqlalchemy import select, update

    from vgpu_ctl.service.leases import Renewal, expiry, is_held, new_holder
    from vgpu_ctl.store.tables import VM
    vm = req(acme, "job1", provision=False)
    holder = new_holder()
    with acme.tx() as conn:
        conn.execute(update(VM).where(VM.c.id == vm.id).values(lease_holder=holder, lease_expires=expiry(0.3)))

    def lease() -> Any:
        with acme.engine.connect() as conn:
            return conn.execute(select(VM.c.lease_holder, VM.c.lease_expires).where(VM.c.id == vm.id)).one()

    with Renewal(acme, vm.id, holder, seconds=0.3):
        time.sleep(0.8)  # well past the first expiry
        assert is_held(*lease())
        report = acme.reconcile(fix=True)
        assert next(f for f in report.findings if f.target == f"vm:{vm.id}").kind == "in-progress"
    time.sleep(0.5)  # the holder stopped renewing: the lease runs out and the VM is finished at once
    assert not is_held(*lease())
    assert acme.reconcile(fix=True).clean
    assert acme.get_vm(vm.id).state == "failed"
