"""What a newcomer meets first (issue 16): inventory apply that removes only with --prune (asking first), no
tracebacks for a bad store URL, a closed pipe that is no error, tables that fit the terminal, -o formats, VM id
prefixes, --version, "did you mean", refusals in an admin's words, host cordon/drain, status --watch, events
--follow, reconcile asking before undefining a running domain, and the Python API. Each check looks at the
message and at the state before and after."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import typing
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DEMO, REPO, Cli, store_snapshot, write_inventory
from test_cli import snapshot

from vgpu_ctl import Controller, PlacedDevice, Placement, VmInfo, __version__
from vgpu_ctl.cli.main import app
from vgpu_ctl.errors import Conflict
from vgpu_ctl.hosts.simulated import SimulatedHost
from vgpu_ctl.service.hosts import simulated_state_dir
from vgpu_ctl.store import tables
from vgpu_ctl.store.tables import VM

EMPTY = "hosts: []\n"
ONE_HOST = """
hosts:
  - name: kvm-new-01
    uri: "simulated:///kvm-new-01"
    driver: simulated
    vcpus: 32
    memory_mib: 131072
"""


def hosts_of(cli: Cli) -> list[str]:
    return [h["name"] for h in cli.json("inventory", "show")["hosts"]]


# -- inventory apply: a file adds and updates; removing needs --prune and a yes ------------------------------

def test_an_empty_file_removes_nothing(cli: Cli, tmp_path: Path) -> None:
    before = snapshot(cli)
    out = cli("inventory", "apply", str(write_inventory(tmp_path, EMPTY)))
    assert out.exit_code == 0, out.output
    assert "no changes" in out.stdout and "kept 6 not in the file" in out.stdout and "--prune" in out.stdout
    assert snapshot(cli) == before
    data = cli.json("inventory", "apply", str(write_inventory(tmp_path, EMPTY)))
    assert data["changes"] == [] and {(k["kind"], k["name"]) for k in data["kept"]} >= {("host", "kvm-a100-01"),
                                                                                       ("pool", "training")}
    assert snapshot(cli) == before


def test_a_file_with_one_host_adds_it_and_keeps_the_others(cli: Cli, tmp_path: Path) -> None:
    out = cli.json("inventory", "apply", str(write_inventory(tmp_path, ONE_HOST)))
    assert [(c["action"], c["kind"], c["name"]) for c in out["changes"]] == [("add", "host", "kvm-new-01")]
    assert hosts_of(cli) == ["kvm-a100-01", "kvm-h100-01", "kvm-l40s-01", "kvm-new-01"]


@pytest.mark.parametrize("answer", ["n\n", ""], ids=["no", "no-answer"])
def test_prune_asks_and_a_no_changes_nothing(cli: Cli, tmp_path: Path, answer: str) -> None:
    before = snapshot(cli)
    out = cli.runner.invoke(app, ["--db", cli.url, "inventory", "apply", str(write_inventory(tmp_path, EMPTY)),
                                  "--prune"], input=answer)
    assert out.exit_code == 1, out.output
    assert "removes:" in out.stderr and "host kvm-a100-01" in out.stderr and "pool training" in out.stderr
    assert "remove these 6?" in out.stderr and "nothing was changed" in out.stderr
    assert snapshot(cli) == before


def test_prune_removes_after_a_yes(cli: Cli, tmp_path: Path) -> None:
    out = cli.runner.invoke(app, ["--db", cli.url, "inventory", "apply", str(write_inventory(tmp_path, EMPTY)),
                                  "--prune"], input="y\n")
    assert out.exit_code == 0, out.output
    assert "remove host kvm-a100-01" in out.stdout and "remove pool training" in out.stdout
    assert hosts_of(cli) == []


def test_prune_yes_does_not_ask(cli: Cli, tmp_path: Path) -> None:
    path = write_inventory(tmp_path, DEMO.read_text()[:DEMO.read_text().index("  - name: kvm-l40s-01")])
    out = cli("inventory", "apply", str(path), "--prune", "--yes")
    assert out.exit_code == 0, out.output
    assert "remove these" not in out.stderr and "remove host kvm-l40s-01" in out.stdout
    assert hosts_of(cli) == ["kvm-a100-01", "kvm-h100-01"]


def test_prune_refuses_removals_the_preview_did_not_show(state_dir: Path, sqlite_url: str, tmp_path: Path) -> None:
    with Controller(sqlite_url) as ctl:
        ctl.apply_inventory(DEMO)
        before = store_snapshot(ctl)
        with pytest.raises(Conflict) as err:  # the admin confirmed one host; the file now removes more
            ctl.apply_inventory(write_inventory(tmp_path, EMPTY), prune=True,
                                expected_removals=[("host", "kvm-a100-01")])
        assert "store changed since the preview" in err.value.message and "host kvm-h100-01" in err.value.message
        assert store_snapshot(ctl) == before


# -- hosts: cordon, drain, uncordon -----------------------------------------------------------------------------

def test_cordon_drain_uncordon(cli: Cli) -> None:
    vm = cli.json("vm", "create", "--tenant", "acme", "--name", "w1", "--profile", "L40S-8C", "--vcpus", "2",
                  "--memory", "2GiB")
    assert vm["host"] == "kvm-l40s-01"
    out = cli("host", "cordon", "kvm-l40s-01")
    assert out.exit_code == 0 and "no new VMs go there (1 VMs stay)" in out.stdout, out.output
    refused = cli.json("vm", "create", "--tenant", "acme", "--name", "w2", "--profile", "L40S-8C", "--vcpus",
                       "2", "--memory", "2GiB", code=3)
    assert refused["error"]["reasons"][0]["counts"] == {"host-draining": 2}
    text = cli("vm", "create", "--tenant", "acme", "--name", "w2", "--profile", "L40S-8C", "--vcpus", "2",
               "--memory", "2GiB")
    assert "2 GPUs on a cordoned (draining) host" in text.stderr
    cli.json("inventory", "apply", str(DEMO))  # a file that gives no state keeps the cordon
    assert next(h for h in cli.json("inventory", "show")["hosts"] if h["name"] == "kvm-l40s-01")["state"] == \
        "draining"
    drained = cli("host", "drain", "kvm-l40s-01")
    assert drained.exit_code == 0 and "1 VMs still on it" in drained.stdout and "acme/w1" in drained.stdout
    assert cli.json("host", "uncordon", "kvm-l40s-01") == {"host": "kvm-l40s-01", "from": "draining",
                                                          "to": "active", "vms": ["acme/w1"]}
    assert cli.json("vm", "create", "--tenant", "acme", "--name", "w2", "--profile", "L40S-8C", "--vcpus", "2",
                    "--memory", "2GiB")["host"] == "kvm-l40s-01"
    events = [e for e in cli.json("events") if e["action"] == "host.state"]
    assert [(e["params"]["from"], e["params"]["to"]) for e in events] == [("active", "draining"),
                                                                          ("draining", "active")]


def test_cordon_unknown_host(cli: Cli) -> None:
    before = snapshot(cli)
    out = cli.json("host", "cordon", "kvm-nope", code=4)
    assert "kvm-nope" in out["error"]["message"] and "kvm-a100-01" in out["error"]["message"]
    assert snapshot(cli) == before


# -- the store URL: exit 2, the URL and the accepted forms, no traceback ---------------------------------------

@pytest.mark.parametrize("url,shown", [
    ("foo.db", "sqlite:///foo.db"),
    ("mysql://root:secret@db/vgpu", "mysql://root:***@db/vgpu"),
    ("sqlite://", "sqlite://"),
])
def test_bad_store_url(state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str,
                       shown: str) -> None:
    monkeypatch.chdir(tmp_path)
    out = Cli(url)("vm", "list")
    assert out.exit_code == 2, out.output
    assert shown in out.stderr and "postgresql://USER" in out.stderr and "Traceback" not in out.output
    assert "secret" not in out.output
    data = Cli(url).json("vm", "list", code=2)
    assert data["error"]["code"] == "invalid" and data["error"]["reasons"][0]["field"] == "db"
    assert not (tmp_path / "foo.db").exists() and list(tmp_path.iterdir()) == [state_dir]
    assert list(state_dir.iterdir()) == []


def test_store_that_cannot_be_opened(state_dir: Path, tmp_path: Path) -> None:
    out = Cli(f"sqlite:///{tmp_path}/no/such/../../x/dir/{'a' * 300}/s.db")("vm", "list")
    assert out.exit_code == 2 and "can't open the store" in out.stderr and "Traceback" not in out.output


@pytest.mark.parametrize("url", ["foo.db", "mysql://root:secret@db/vgpu", "sqlite://"])
def test_python_api_names_a_bad_store_url(state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          url: str) -> None:
    from vgpu_ctl import Controller, InvalidInput
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as err:
        Controller(url)
    assert "postgresql://USER" in str(err.value) and "secret" not in str(err.value)
    assert err.value.reasons[0]["field"] == "db"
    assert list(tmp_path.iterdir()) == [state_dir] and list(state_dir.iterdir()) == []


def test_python_api_store_that_cannot_be_opened(state_dir: Path, tmp_path: Path) -> None:
    from vgpu_ctl import Controller, InvalidInput
    with pytest.raises(InvalidInput, match="can't open the store"):
        Controller(f"sqlite:///{tmp_path}/no/such/../../x/dir/{'a' * 300}/s.db")


def test_postgres_without_the_driver_names_the_extra(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as in a plain install
    out = Cli("postgresql://vgpu:pw@localhost/vgpu")("vm", "list")
    assert out.exit_code == 2, out.output
    assert "pip install 'vgpu-ctl[postgres]'" in out.stderr and "psycopg" in out.stderr
    assert "pw@" not in out.stderr


def test_missing_postgres_database(state_dir: Path) -> None:
    from conftest import PG_BASE, pg_admin
    try:
        pg_admin().close()
    except Exception as exc:
        pytest.skip(f"PostgreSQL not reachable: {exc}")
    out = Cli(f"{PG_BASE}/vgpu_no_such_db_{uuid.uuid4().hex[:6]}")("vm", "list")
    assert out.exit_code == 2, out.output
    assert "can't open the store" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.output


# -- a closed pipe ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,code", [(["vm", "list"], 0), (["status"], 0), (["vm", "show", "nope"], 4)])
def test_closed_stdout_is_not_an_error(cli: Cli, args: list[str], code: int) -> None:
    env = {**os.environ, "VGPU_CTL_DATABASE_URL": cli.url}
    proc = subprocess.Popen([sys.executable, "-c", "from vgpu_ctl.cli.main import entry; entry()", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before vgpuctl writes: `vgpuctl vm list | true`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == code, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
    assert (err == "") == (code == 0)


# -- tables fit the terminal; -o; id prefixes -----------------------------------------------------------------------

def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("args", [["status"], ["events"], ["vm", "list"], ["profiles", "list"],
                                  ["tenant", "usage", "acme"], ["pool", "list"], ["tenant", "list"]])
def test_tables_fit_80_columns(cli: Cli, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    for i in range(3):
        cli.json("vm", "create", "--tenant", "acme", "--name", f"v{i}", "--profile", "1g.10gb", "--vcpus", "1",
                 "--memory", "1GiB")
    monkeypatch.setenv("COLUMNS", "80")
    out = cli(*args)
    assert out.exit_code == 0, out.output
    assert _widest(out.stdout) <= 80, out.stdout
    wide = cli(*args, "-o", "wide")
    assert wide.exit_code == 0, wide.output


def test_vm_list_short_ids_are_accepted_back(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    vm = cli.json("vm", "create", "--tenant", "acme", "--name", "web", "--profile", "1g.10gb", "--vcpus", "1",
                  "--memory", "1GiB")
    monkeypatch.setenv("COLUMNS", "80")
    listed = cli("vm", "list").stdout
    short = vm["id"][:8]
    assert short in listed and vm["id"] not in listed
    assert vm["id"] in cli("vm", "list", "-o", "wide").stdout
    assert cli.json("vm", "show", short)["id"] == vm["id"]
    assert cli.json("vm", "show", vm["id"][:4])["id"] == vm["id"]
    assert cli.json("vm", "show", vm["id"][:3], code=4)["error"]["code"] == "not_found"  # too short to be a prefix
    assert cli.json("vm", "stop", short)["state"] == "stopped"
    assert cli.json("vm", "delete", short) == {"deleted": short}
    assert cli.json("vm", "list") == []


def test_an_ambiguous_id_prefix_is_refused(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import vgpu_ctl.service.claim as claim_module
    ids = iter([uuid.UUID("abcd1234-0000-4000-8000-000000000001"), uuid.UUID("abcd5678-0000-4000-8000-000000000002")])

    class FakeUuid:
        @staticmethod
        def uuid4() -> uuid.UUID:
            return next(ids)

    monkeypatch.setattr(claim_module, "uuid", FakeUuid)
    with Controller(cli.url) as ctl:
        for name in ("a", "b"):
            ctl.request_vm("acme", name, [("1g.10gb", 1)], vcpus=1, memory_mib=1024, provision=False)
    before = snapshot(cli)
    out = cli.json("vm", "delete", "abcd", code=2)
    assert "'abcd' matches 2 VMs" in out["error"]["message"] and "abcd1234-000" in out["error"]["message"]
    assert snapshot(cli) == before
    assert cli.json("vm", "show", "abcd5")["name"] == "b"


def test_output_formats(cli: Cli) -> None:
    cli.json("vm", "create", "--tenant", "acme", "--name", "web", "--profile", "1g.10gb", "--vcpus", "1",
             "--memory", "1GiB")
    as_json = cli.json("vm", "list")
    out = cli("vm", "list", "-o", "json")
    assert out.exit_code == 0 and json.loads(out.stdout) == as_json
    out = cli("vm", "list", "-o", "yaml")
    assert out.exit_code == 0 and yaml.safe_load(out.stdout) == as_json
    out = cli("tenant", "usage", "acme", "--output=yaml")
    assert yaml.safe_load(out.stdout)["tenant"] == "acme"
    bad = cli("vm", "list", "-o", "xml", "--json")
    assert bad.exit_code == 2 and json.loads(bad.stdout)["error"]["code"] == "usage"
    err = cli("vm", "show", "nope", "-o", "yaml")
    assert err.exit_code == 4 and yaml.safe_load(err.stdout)["error"]["code"] == "not_found"


@pytest.mark.parametrize("args,text", [
    (["vm", "create", "--tenant", "acme", "--name", "x", "--profile", "1g.10gb", "--vcpus", "many",
      "--memory", "1GiB"], "Invalid value for '--vcpus'"),
    (["vm", "list", "--bogus"], "No such option: --bogus"),
    (["vm", "create", "--tenant", "acme"], "Missing option"),
])
def test_usage_errors_with_json_are_json(cli: Cli, args: list[str], text: str) -> None:
    before = snapshot(cli)
    out = cli(*args, "--json")
    assert out.exit_code == 2, out.output
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "usage" and text in err["message"], err
    assert "╭" not in out.output
    assert snapshot(cli) == before


# -- --version, did you mean, refusals in words, quota below usage ---------------------------------------------

def test_version(state_dir: Path) -> None:
    from importlib.metadata import version
    out = Cli("sqlite:///unused.db")("--version")
    assert out.exit_code == 0 and out.stdout == f"vgpuctl {__version__}\n"
    assert __version__ == version("vgpu-ctl")


def test_did_you_mean_profile_and_model(cli: Cli) -> None:
    before = snapshot(cli)
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "x", "--profile", "a100d-10c", "--vcpus", "1",
                   "--memory", "1GiB", code=2)
    assert "unknown profile 'a100d-10c' (did you mean 'A100D-10C'?)" in out["error"]["message"]
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "x", "--profile", "1g.11gb", "--vcpus", "1",
                   "--memory", "1GiB", code=2)
    assert "did you mean" in out["error"]["message"] and "'1g.10gb'" in out["error"]["message"]
    out = cli.json("quota", "set", "acme", "--profile", "A100D-1OC=2", code=2)
    assert "did you mean" in out["error"]["message"] and "'A100D-10C'" in out["error"]["message"]
    assert snapshot(cli) == before
    lower = cli.json("profiles", "list", "--model", "h100-80gb")
    assert lower == cli.json("profiles", "list", "--model", "H100-80GB") and lower
    out = cli.json("profiles", "list", "--model", "H10-80GB", code=2)
    assert "did you mean 'H100-80GB'" in out["error"]["message"]


def test_refusal_counts_add_up_and_read_as_words(cli: Cli) -> None:
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "big", "--profile", "A100D-40C", "--count", "3",
                   "--vcpus", "8", "--memory", "32GiB", code=3)
    for r in out["error"]["reasons"]:
        assert sum(r["counts"].values()) == r["gpus"], r
    text = cli("vm", "create", "--tenant", "acme", "--name", "big", "--profile", "A100D-40C", "--count", "3",
               "--vcpus", "8", "--memory", "32GiB")
    assert text.exit_code == 3
    assert "2 GPUs with room, on a host without room for all the VM's vGPUs" in text.stderr
    assert "1 GPU whose model or mode does not offer the profile" in text.stderr
    assert "holding (or pinned to) another vGPU type" in text.stderr
    for internal in ("fits-alone", "other-mode", "not-in-layout", "max-count", "host-too-few-gpus", "other-type"):
        assert internal not in text.stderr


def test_quota_below_usage_is_set_with_a_warning(cli: Cli) -> None:
    cli.json("vm", "create", "--tenant", "acme", "--name", "a", "--profile", "1g.10gb", "--vcpus", "4",
             "--memory", "1GiB")
    out = cli("quota", "set", "acme", "--vms", "0", "--vcpus", "8")
    assert out.exit_code == 0, out.output
    assert "already uses 1 vms, more than the new limit 0" in out.stderr and "keep running" in out.stderr
    assert "vcpus" not in out.stderr  # 4 of 8: not below
    data = cli.json("quota", "set", "acme", "--vms", "0")
    assert data["below_usage"] == [{"resource": "vms", "limit": 0, "used": 1}]
    assert [v["name"] for v in cli.json("vm", "list")] == ["a"]  # nothing was taken away


def test_every_argument_and_option_has_help() -> None:
    import typer.main
    missing = []

    def walk(cmd: Any, path: str) -> None:
        for p in cmd.params:
            if not getattr(p, "help", None) and p.name != "help":
                missing.append(f"{path} {p.name}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "vgpuctl")
    assert missing == []


# -- status --watch, events --follow ---------------------------------------------------------------------------------

class _Stop(Exception):
    pass


def test_status_watch_redraws_until_interrupted(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import vgpu_ctl.cli.ops as ops
    calls: list[float] = []

    def sleep(seconds: float) -> None:
        calls.append(seconds)
        if len(calls) % 2 == 0:  # each command stops at its second pause
            raise KeyboardInterrupt

    monkeypatch.setattr(ops, "_pause", sleep)
    out = cli("status", "--watch", "2")
    assert out.exit_code == 0, out.output
    assert calls == [2.0, 2.0] and out.stdout.count("Pools") == 2
    calls.clear()
    out = cli("status", "--watch", "1", "-o", "json")
    docs = [json.loads(d) for d in re.split(r"\n(?=\{)", out.stdout.strip())]
    assert len(docs) == 2 and all(set(d) == {"summary", "pools", "tenants"} for d in docs)
    assert cli("status", "--watch", "0").exit_code == 2


def test_events_follow_prints_each_new_event_once(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import vgpu_ctl.cli.ops as ops
    calls = 0

    def sleep(_seconds: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            with Controller(cli.url) as ctl:
                ctl.create_tenant("newcomer")
        if calls == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ops, "_pause", sleep)
    out = cli("events", "--follow", "--json")
    assert out.exit_code == 0, out.output
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["action"] for e in events] == ["inventory.apply", "tenant.create", "tenant.create"]
    assert [e["target"] for e in events][1:] == ["acme", "newcomer"]
    assert len({e["id"] for e in events}) == 3


# -- reconcile asks before undefining a running domain; each store has its own simulated hosts ------------------

def _forget_vm(url: str) -> str:
    """A running VM whose store rows are gone (as after restoring an older backup); its domain name."""
    with Controller(url) as ctl:
        vm = ctl.request_vm("acme", "keep", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="training")
        with ctl.tx() as conn:
            conn.execute(tables.DEVICE.delete().where(tables.DEVICE.c.vm_id == vm.id))
            conn.execute(VM.delete().where(VM.c.id == vm.id))
            conn.execute(tables.TENANT.update().values(vms_used=0, vgpus_used=0, framebuffer_mib_used=0,
                                                      vcpus_used=0, memory_mib_used=0))
        return next(d.name for d in ctl.hosts.get(_host(ctl, "kvm-a100-01")).list_domains())


def _host(ctl: Controller, name: str) -> Any:
    from sqlalchemy import select
    with ctl.engine.connect() as conn:
        return conn.execute(select(tables.HOST).where(tables.HOST.c.name == name)).one()


def _domains(url: str) -> list[str]:
    with Controller(url) as ctl:
        return [d.name for d in ctl.hosts.get(_host(ctl, "kvm-a100-01")).list_domains()]


def test_reconcile_fix_asks_before_undefining_a_running_domain(cli: Cli) -> None:
    name = _forget_vm(cli.url)
    out = cli.runner.invoke(app, ["--db", cli.url, "reconcile", "--fix"], input="n\n")
    assert out.exit_code == 1, out.output
    assert f"domain {name} is running, but its VM is not in this store" in out.stderr
    assert "left running (not confirmed)" in out.stdout
    assert _domains(cli.url) == [name]
    out = cli.runner.invoke(app, ["--db", cli.url, "reconcile", "--fix"], input="y\n")
    assert f"unknown-domain kvm-a100-01 {name}" in out.stdout and "fixed" in out.stdout
    assert _domains(cli.url) == []


def test_reconcile_fix_yes_does_not_ask(cli: Cli) -> None:
    name = _forget_vm(cli.url)
    report = cli.json("reconcile", "--fix", "--yes")
    assert any(f["kind"] == "unknown-domain" and f["target"] == name and f["fixed"] for f in report["findings"])
    assert _domains(cli.url) == []


def test_each_store_has_its_own_simulated_hosts(state_dir: Path, tmp_path: Path) -> None:
    first, second = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    for url in (first, second):
        Cli(url).json("inventory", "apply", str(DEMO))
        Cli(url).json("tenant", "create", "acme")
    vm = Cli(first).json("vm", "create", "--tenant", "acme", "--name", "a", "--profile", "A100D-20C", "--vcpus",
                         "2", "--memory", "2GiB", "--pool", "training")
    report = Cli(second).json("reconcile", "--fix", "--yes")
    assert report["findings"] == [] and report["clean"]  # the second store sees none of the first's domains
    assert [d.uuid for d in SimulatedHost("kvm-a100-01", simulated_state_dir(first, state_dir)).list_domains()] \
        == [vm["id"]]
    assert simulated_state_dir(first, state_dir) == state_dir / "hosts"  # the first store to use it owns it
    assert simulated_state_dir(second, state_dir) != simulated_state_dir(first, state_dir)
    assert Cli(first).json("reconcile")["clean"]


# -- the Python API ---------------------------------------------------------------------------------------------------

def test_request_vm_is_typed() -> None:
    from vgpu_ctl.service.requests import OperationInfo
    returns = [typing.get_type_hints(f)["return"] for f in typing.get_overloads(Controller.request_vm)]
    # queue=True: the VM, or the pending operation when it has to wait (the scheduling issue)
    assert returns == [VmInfo, VmInfo | OperationInfo, Placement, VmInfo | Placement | OperationInfo]


def test_api_dry_run_devices_path_and_context_manager(state_dir: Path, sqlite_url: str) -> None:
    closed = []
    with Controller(sqlite_url) as ctl:
        ctl.close = lambda: closed.append(True)  # type: ignore[method-assign]
        assert ctl.apply_inventory(str(DEMO))  # a str path is fine
        ctl.create_tenant("acme")
        plan = ctl.request_vm("acme", "x", [("3g.40gb", 1)], vcpus=1, memory_mib=1024, dry_run=True)
        assert isinstance(plan, Placement)
        (dev,) = plan.devices
        assert isinstance(dev, PlacedDevice) and dev.profile == "3g.40gb" and dev.gpu.startswith("kvm-h100-01/")
        assert plan.to_dict()["devices"] == [{"gpu": dev.gpu, "profile": "3g.40gb", "start": dev.start,
                                              "size": dev.size}]
    assert closed == [True]


def test_readme_python_snippet_runs_on_a_fresh_store(state_dir: Path, tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    env = {**os.environ, "VGPU_CTL_STATE_DIR": str(tmp_path / "fresh")}
    env.pop("VGPU_CTL_DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-c", snippet.group(1)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kvm-" in done.stdout
    assert (tmp_path / "fresh" / "vgpu-ctl.db").exists()


def test_console_script_and_postgres_extra() -> None:
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["vgpuctl"] == "vgpu_ctl.cli.main:entry"  # the closed-pipe handling runs there
    assert any(d.startswith("psycopg") for d in project["optional-dependencies"]["postgres"])
