"""The vgpuctl CLI: JSON output, exit codes (2 invalid, 3 refused, 4 not found) and error messages that
name the field and value, with nothing changed by a refused command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Cli, store_snapshot
from lxml import etree

from vgpu_ctl import Controller


def snapshot(cli: Cli) -> dict[str, Any]:
    c = Controller(cli.url)
    try:
        return store_snapshot(c)
    finally:
        c.close()


def test_profiles_list_json(state_dir: Path, sqlite_url: str) -> None:
    profiles = Cli(sqlite_url).json("profiles", "list", "--model", "H100-80GB")
    by_name = {p["name"]: p for p in profiles}
    p = by_name["3g.40gb"]
    assert (p["compute_slices"], p["memory_slices"], p["placements"], p["size"]) == (3, 4, [0, 4], 4)
    assert p["kind"] == "mig" and p["model"] == "H100-80GB"
    assert {x["model"] for x in profiles} == {"H100-80GB"}
    table = Cli(sqlite_url)("profiles", "list", "--model", "H100-80GB")
    assert table.exit_code == 0 and "3g.40gb" in table.stdout


def test_profiles_list_unknown_model(state_dir: Path, sqlite_url: str) -> None:
    out = Cli(sqlite_url)("profiles", "list", "--model", "Z999", "--json")
    assert out.exit_code != 0
    assert "Z999" in json.loads(out.stdout)["error"]["message"]


def test_tenant_create_list_delete(cli: Cli) -> None:
    assert cli.json("tenant", "create", "beta") == {"name": "beta"}
    names = [t["name"] for t in cli.json("tenant", "list")]
    assert names == ["acme", "beta"]
    dup = cli.json("tenant", "create", "beta", code=5)
    assert dup["error"]["code"] == "conflict" and "beta" in dup["error"]["message"]
    bad = cli.json("tenant", "create", "Bad Name", code=2)
    assert "Bad Name" in bad["error"]["message"] and bad["error"]["reasons"][0]["field"] == "tenant"
    assert cli.json("tenant", "delete", "beta") == {"deleted": "beta"}
    assert [t["name"] for t in cli.json("tenant", "list")] == ["acme"]
    missing = cli.json("tenant", "delete", "beta", code=4)
    assert missing["error"]["code"] == "not_found" and "beta" in missing["error"]["message"]
    text = cli("tenant", "list")
    assert text.exit_code == 0 and "acme" in text.stdout


def test_quota_set_with_sizes(cli: Cli) -> None:
    out = cli.json("quota", "set", "acme", "--vms", "3", "--framebuffer", "80GiB", "--memory", "512GiB",
                   "--profile", "1g.10gb=2")
    assert out["limits"] == {"vms": 3, "framebuffer_mib": 81920, "memory_mib": 524288, "profile:1g.10gb": 2}
    usage = {(r["scope"], r["resource"]): r["limit"] for r in cli.json("tenant", "usage", "acme")["usage"]}
    assert usage[("*", "framebuffer_mib")] == 81920 and usage[("*", "profile:1g.10gb")] == 2
    out = cli.json("quota", "set", "acme", "--pool", "inference", "--vgpus", "4")
    assert out == {"tenant": "acme", "pool": "inference", "limits": {"vgpus": 4}, "below_usage": []}
    out = cli.json("quota", "set", "acme", "--vms", "unlimited")
    assert out["limits"] == {"vms": None}


@pytest.mark.parametrize("args,field,value", [
    (["--vms", "-1"], "vms", "-1"),
    (["--vms", "many"], "vms", "many"),
    (["--framebuffer", "lots"], "framebuffer", "lots"),
    (["--memory", "1.5MiB"], "memory", "1.5MiB"),
    (["--profile", "1g.10gb"], "profile", "1g.10gb"),
    (["--profile", "1g.10gb=-3"], "profile", "-3"),
    (["--profile", "nope=3"], "profile", "nope"),
])
def test_quota_set_bad_values(cli: Cli, args: list[str], field: str, value: str) -> None:
    cli.json("quota", "set", "acme", "--vgpus", "9")
    before = snapshot(cli)
    out = cli("quota", "set", "acme", "--vgpus", "4", *args)
    assert out.exit_code == 2, out.output
    assert field in out.stderr and value in out.stderr, out.stderr
    as_json = cli.json("quota", "set", "acme", "--vgpus", "4", *args, code=2)
    assert as_json["error"]["code"] == "invalid"
    assert field in as_json["error"]["message"] and value in as_json["error"]["message"]
    assert as_json["error"]["reasons"][0]["field"] == field
    assert snapshot(cli) == before


def test_quota_set_unknown_tenant_and_pool(cli: Cli) -> None:
    before = snapshot(cli)
    assert cli.json("quota", "set", "nobody", "--vms", "1", code=4)["error"]["code"] == "not_found"
    out = cli.json("quota", "set", "acme", "--pool", "nowhere", "--vms", "1", code=4)
    assert "nowhere" in out["error"]["message"]
    assert cli.json("quota", "set", "acme", code=2)["error"]["code"] == "invalid"  # no limit given
    assert snapshot(cli) == before


def test_vm_create_show_list_xml_delete(cli: Cli) -> None:
    vm = cli.json("vm", "create", "--tenant", "acme", "--name", "web-1", "--profile", "3g.40gb", "--vcpus", "4",
                  "--memory", "16GiB", "--pool", "inference")
    for key in ("id", "name", "tenant", "host", "state", "devices"):
        assert key in vm
    assert (vm["name"], vm["tenant"], vm["host"], vm["state"], vm["memory_mib"]) == \
        ("web-1", "acme", "kvm-h100-01", "running", 16384)
    dev = vm["devices"][0]
    assert dev["gpu"].startswith("kvm-h100-01/") and dev["profile"] == "3g.40gb" and dev["start"] in (0, 4)
    assert cli.json("vm", "show", "acme/web-1") == vm
    assert cli.json("vm", "show", vm["id"]) == vm
    assert [v["id"] for v in cli.json("vm", "list")] == [vm["id"]]
    assert [v["id"] for v in cli.json("vm", "list", "--tenant", "acme")] == [vm["id"]]
    shown = cli("vm", "show", "acme/web-1")
    assert shown.exit_code == 0 and "web-1" in shown.stdout and "3g.40gb" in shown.stdout
    listed = cli("vm", "list")
    assert listed.exit_code == 0 and "web-1" in listed.stdout
    xml = cli("vm", "xml", "acme/web-1")
    assert xml.exit_code == 0, xml.output
    root = etree.fromstring(xml.stdout.encode())
    assert root.tag == "domain" and root.findtext("uuid") == vm["id"]
    assert root.find(".//hostdev") is not None
    plan = cli.json("vm", "create", "--tenant", "acme", "--name", "web-2", "--profile", "1g.10gb", "--vcpus", "1",
                    "--memory", "1024", "--dry-run")
    assert plan["host"] == "kvm-h100-01" and plan["devices"][0]["profile"] == "1g.10gb"
    assert cli.json("vm", "delete", "acme/web-1") == {"deleted": "acme/web-1"}
    assert cli.json("vm", "list") == []
    gone = cli.json("vm", "show", "acme/web-1", code=4)
    assert gone["error"]["code"] == "not_found" and "web-1" in gone["error"]["message"]
    assert cli("vm", "xml", "acme/web-1").exit_code == 4


def test_vm_create_refused_json(cli: Cli) -> None:
    cli.json("quota", "set", "acme", "--vms", "0")
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "x", "--profile", "1g.10gb", "--vcpus", "1",
                   "--memory", "1GiB", code=3)
    err = out["error"]
    assert set(err) == {"code", "message", "reasons"}
    assert err["code"] == "quota_exceeded"
    assert err["reasons"][0] | {} == {"kind": "quota", "tenant": "acme", "scope": "*", "resource": "vms",
                                      "limit": 0, "used": 0, "requested": 1}
    cli.json("quota", "set", "acme", "--vms", "unlimited")
    out = cli.json("vm", "create", "--tenant", "acme", "--name", "x", "--profile", "A100-80GB", "--vcpus", "1000",
                   "--memory", "1GiB", code=3)
    assert out["error"]["code"] == "no_capacity"
    assert out["error"]["reasons"] == [{"kind": "capacity", "pool": "training", "gpus": 3, "counts": {"vcpus": 3}}]
    text = cli("vm", "create", "--tenant", "acme", "--name", "x", "--profile", "A100-80GB", "--vcpus", "1000",
               "--memory", "1GiB")
    assert text.exit_code == 3 and "pool training" in text.stderr and "3 GPUs on a host short of vCPUs" in text.stderr
    assert cli.json("vm", "list") == []


@pytest.mark.parametrize("args,code,field,value", [
    (["--tenant", "nobody"], 4, "tenant", "nobody"),
    (["--pool", "nowhere"], 4, "pool", "nowhere"),
    (["--name", "a b"], 2, "name", "a b"),
    (["--name", "<x>"], 2, "name", "<x>"),
    (["--profile", "A100D-3C"], 2, "profile", "A100D-3C"),
    (["--vcpus", "0"], 2, "vcpus", "0"),
    (["--count", "0"], 2, "count", "0"),
    (["--memory", "lots"], 2, "memory", "lots"),
    (["--label", "rack"], 2, "label", "rack"),
])
def test_vm_create_bad_input(cli: Cli, args: list[str], code: int, field: str, value: str) -> None:
    base = {"--tenant": "acme", "--name": "vm1", "--profile": "1g.10gb", "--vcpus": "1", "--memory": "1GiB"}
    override = dict(zip(args[::2], args[1::2], strict=True))
    argv = [x for k, v in {**base, **override}.items() for x in (k, v)]
    before = snapshot(cli)
    out = cli.json("vm", "create", *argv, code=code)
    err = out["error"]
    assert field in err["message"] and value in err["message"], err
    assert snapshot(cli) == before
