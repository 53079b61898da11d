"""`vgpuctl --server URL --token T`: every command that makes sense remotely prints what it prints on the store
(-o json) with the same exit code, refusals included; commands of the store's machine are refused."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from serverfixtures import VGPUCTL, RunningServer, free_port, shared_server

__all__ = ["shared_server"]  # the fixture, used by name
SMALL = ["--vcpus", "2", "--memory", "4GiB"]


def _json(p: subprocess.CompletedProcess[str]) -> Any:
    try:
        return json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (exit {p.returncode}): {p.stdout!r} {p.stderr!r}") from None


def both(srv: RunningServer, *args: str, token: str | None = None) -> tuple[Any, int]:
    """Run a command on the store and through the server (as the admin, or as `token`'s holder); assert both
    print the same and end with the same exit code; what they printed (JSON when it is) and the code."""
    local = srv.cli(*args, token=token, remote=False)
    remote = srv.cli(*args, token=token if token is not None else srv.admin_token)
    assert remote.returncode == local.returncode, (args, local.stdout, local.stderr, remote.stdout, remote.stderr)
    if "yaml" in args:
        assert yaml.safe_load(remote.stdout) == yaml.safe_load(local.stdout), args
        return yaml.safe_load(local.stdout), local.returncode
    if "-o" in args:
        assert _json(remote) == _json(local), args
        return _json(local), local.returncode
    assert remote.stdout == local.stdout, args
    assert remote.stderr == local.stderr, args
    return local.stdout + local.stderr, local.returncode


def _create(srv: RunningServer, name: str, token: str, *extra: str, tenant: str = "acme") -> Any:
    p = srv.cli("vm", "create", "--tenant", tenant, "--name", name, *extra, *SMALL, "-o", "json", token=token)
    assert p.returncode == 0, p.stdout + p.stderr
    return _json(p)


def test_a_tenant_with_only_a_token_and_the_url_runs_its_vms(shared_server: RunningServer) -> None:
    env = {**shared_server.env(), "VGPU_CTL_SERVER": shared_server.url, "VGPU_CTL_TOKEN": shared_server.tenant_token}

    def vgpuctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([VGPUCTL, *args], env=env, capture_output=True, text=True, timeout=120, check=False)

    name = f"env-{uuid.uuid4().hex[:6]}"
    made = vgpuctl("vm", "create", "--tenant", "acme", "--name", name, "--profile", "A100D-10C", *SMALL, "-o", "json")
    assert made.returncode == 0, made.stdout + made.stderr
    vm = _json(made)
    assert vm["state"] == "running" and vm["tenant"] == "acme"
    listed = vgpuctl("vm", "list", "-o", "json")
    assert vm["id"] in [v["id"] for v in _json(listed)]
    table = vgpuctl("vm", "list")
    assert table.returncode == 0 and vm["id"][:8] in table.stdout and name in table.stdout
    assert _json(vgpuctl("vm", "show", f"acme/{name}", "-o", "json"))["id"] == vm["id"]
    assert _json(vgpuctl("vm", "stop", vm["id"][:8], "-o", "json"))["state"] == "stopped"
    assert _json(vgpuctl("vm", "start", name, "-o", "json"))["state"] == "running"
    assert "<domain" in vgpuctl("vm", "xml", name).stdout
    deleted = vgpuctl("vm", "delete", name, "-o", "json")
    assert deleted.returncode == 0 and _json(deleted) == {"deleted": name}
    gone = vgpuctl("vm", "show", vm["id"], "-o", "json")
    assert gone.returncode == 4 and _json(gone)["error"]["code"] == "not_found"


def test_reads_print_the_same_locally_and_remotely(shared_server: RunningServer) -> None:
    srv = shared_server
    name = f"same-{uuid.uuid4().hex[:6]}"
    vm = _create(srv, name, srv.tenant_token, "--profile", "H100-1-10C", "--pool", "inference")
    acme = srv.tenant_token
    reads: list[tuple[str, ...]] = [
        ("vm", "list", "-o", "json"), ("vm", "show", name, "-o", "json"), ("vm", "show", f"acme/{name}", "-o", "yaml"),
        ("tenant", "usage", "acme", "-o", "json"), ("pool", "list", "-o", "json"), ("tenant", "list", "-o", "json"),
        ("events", "--tenant", "acme", "--limit", "5", "-o", "json")]
    for args in reads:
        out, code = both(srv, *args, token=acme)
        assert code == 0, (args, out)
    assert "<domain" in both(srv, "vm", "xml", vm["id"], token=acme)[0]
    admin_reads: list[tuple[str, ...]] = [
        ("inventory", "show", "-o", "json"), ("status", "-o", "json"),
        ("status", "--gpus", "--limit", "3", "-o", "json"), ("doctor", "-o", "json"), ("tenant", "list", "-o", "json"),
        ("profiles", "list", "--model", "L40S", "-o", "json"), ("vm", "list", "--tenant", "acme", "-o", "json"),
        ("quota", "set", "acme", "--vms", "unlimited", "-o", "json")]
    for args in admin_reads:
        out, code = both(srv, *args)
        assert code == 0, (args, out)
    assert both(srv, "doctor")[0].endswith("store is consistent\n")
    assert srv.cli("vm", "delete", vm["id"], token=acme).returncode == 0


def test_refusals_print_the_same_with_the_same_exit_code(shared_server: RunningServer) -> None:
    srv = shared_server
    bad, code = both(srv, "vm", "create", "--tenant", "acme", "--name", "bad", "--profile", "A100D-11C", *SMALL,
                     "-o", "json", token=srv.tenant_token)
    assert code == 2 and bad["error"]["code"] == "invalid"
    assert bad["error"]["reasons"] == [{"field": "profile", "value": "A100D-11C"}]

    capped = f"capped-{uuid.uuid4().hex[:6]}"
    assert srv.cli("tenant", "create", capped).returncode == 0
    assert srv.cli("quota", "set", capped, "--vgpus", "0").returncode == 0
    token = _json(srv.cli("tenant", "token", capped, "-o", "json"))["token"]
    over, code = both(srv, "vm", "create", "--tenant", capped, "--name", "x", "--profile", "A100D-10C", *SMALL,
                      "-o", "json", token=token)
    assert code == 3 and over["error"]["code"] == "quota_exceeded"
    assert [(r["kind"], r["resource"], r["limit"]) for r in over["error"]["reasons"]] == [("quota", "vgpus", 0)]
    text, code = both(srv, "vm", "create", "--tenant", capped, "--name", "x", "--profile", "A100D-10C", *SMALL,
                      token=token)
    assert code == 3 and "vgpus (all pools): used 0 + requested 1 > limit 0" in text

    name = f"mine-{uuid.uuid4().hex[:6]}"
    vm = _create(srv, name, srv.tenant_token, "--profile", "A100D-10C")
    for args in (("vm", "show", vm["id"], "-o", "json"), ("vm", "show", f"acme/{name}", "-o", "json"),
                 ("vm", "delete", vm["id"], "-o", "json"), ("vm", "stop", vm["id"], "-o", "json")):
        out, code = both(srv, *args, token=srv.other_token)  # globex asks for acme's VM
        assert code == 4 and out["error"]["code"] == "not_found", args
    sched = srv.cli("vm", "create", "--tenant", "acme", "--name", "p", "--profile", "A100D-10C", *SMALL,
                    "--priority", "high", "-o", "json", token=srv.tenant_token)
    assert sched.returncode == 2 and _json(sched)["error"]["reasons"] == [{"field": "priority", "value": "high"}]
    denied, code = both(srv, "tenant", "create", "sneaky", "-o", "json", token=srv.tenant_token)
    assert code == 7 and denied["error"]["code"] == "permission_denied"
    assert srv.cli("vm", "delete", vm["id"], token=srv.tenant_token).returncode == 0


@pytest.mark.parametrize("args", [("db", "backup", "BACKUP"), ("init",), ("host", "check", "kvm-a100-01"),
                                  ("host", "discover", "test:///default"), ("serve",), ("metrics", "serve"),
                                  ("metrics", "sample"), ("db", "repair-usage")])
def test_commands_of_the_stores_machine_are_refused_with_server(shared_server: RunningServer, tmp_path: Path,
                                                               args: tuple[str, ...]) -> None:
    backup = tmp_path / "backup.db"
    args = tuple(str(backup) if a == "BACKUP" else a for a in args)
    path = args[:2] if args[0] in ("db", "host", "metrics") else args[:1]
    text = shared_server.cli(*args)
    assert text.returncode == 2, text.stdout + text.stderr
    assert f"`vgpuctl {' '.join(path)}`" in text.stderr and f"--server {shared_server.url}" in text.stderr
    machine = shared_server.cli(*args, "-o", "json")
    assert machine.returncode == 2
    assert _json(machine)["error"]["reasons"] == [{"field": "server", "value": shared_server.url,
                                                   "command": " ".join(path)}]
    assert not backup.exists()


def test_a_server_needs_a_token_a_url_and_no_store(shared_server: RunningServer) -> None:
    env = shared_server.env()

    def vgpuctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([VGPUCTL, *args], env=env, capture_output=True, text=True, timeout=120, check=False)

    no_token = vgpuctl("--server", shared_server.url, "vm", "list", "-o", "json")
    assert no_token.returncode == 2 and _json(no_token)["error"]["reasons"] == [{"field": "token"}]
    assert "--token" in _json(no_token)["error"]["message"]
    both_ways = vgpuctl("--server", shared_server.url, "--db", shared_server.db, "vm", "list")
    assert both_ways.returncode == 2 and "--db" in both_ways.stderr and "--server" in both_ways.stderr
    bad_url = vgpuctl("--server", "ftp://nowhere", "--token", "x", "vm", "list", "-o", "json")
    assert bad_url.returncode == 2
    assert _json(bad_url)["error"]["reasons"] == [{"field": "server", "value": "ftp://nowhere"}]
    down = f"http://127.0.0.1:{free_port()}"
    unreachable = vgpuctl("--server", down, "--token", "x", "vm", "list", "-o", "json")
    assert unreachable.returncode == 1 and _json(unreachable)["error"]["code"] == "unreachable"
    wrong, code = both(shared_server, "vm", "list", "-o", "json", token="vgt-wrong")
    assert code == 7 and wrong["error"]["code"] == "permission_denied" and "not valid" in wrong["error"]["message"]


def test_inventory_apply_prints_the_same_and_names_the_callers_file(shared_server: RunningServer,
                                                                    tmp_path: Path) -> None:
    from serverfixtures import DEMO
    srv = shared_server
    out, code = both(srv, "inventory", "apply", str(DEMO), "--dry-run", "-o", "json")
    assert code == 0 and out["changes"] == []
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools:\n  - name: x\n    policy: nope\n")
    err, code = both(srv, "inventory", "apply", str(broken), "-o", "json")
    assert code == 2 and str(broken) in err["error"]["message"]
    missing, code = both(srv, "inventory", "apply", str(tmp_path / "none.yaml"), "-o", "json")
    assert code == 2 and "cannot read" in missing["error"]["message"]
    smaller = tmp_path / "smaller.yaml"  # the demo without its last host: --prune removes it, after asking
    text = DEMO.read_text()
    smaller.write_text(text[:text.index("  - name: kvm-l40s-01")])
    preview = _json(srv.cli("inventory", "apply", str(smaller), "--prune", "--dry-run", "-o", "json"))
    assert ("remove", "host", "kvm-l40s-01") in {(c["action"], c["kind"], c["name"]) for c in preview["changes"]}
    refused = srv.cli("inventory", "apply", str(smaller), "--prune", "-o", "json", input="n\n")
    assert refused.returncode == 1 and _json(refused)["error"]["code"] == "not_confirmed"
    assert "kvm-l40s-01" in [h["name"] for h in _json(srv.cli("inventory", "show", "-o", "json"))["hosts"]]
    confirmed = srv.cli("inventory", "apply", str(smaller), "--prune", "-o", "json", input="y\n")
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert "kvm-l40s-01" not in [h["name"] for h in _json(srv.cli("inventory", "show", "-o", "json"))["hosts"]]
    assert srv.cli("inventory", "apply", str(DEMO)).returncode == 0  # the shared server's fleet as it was
