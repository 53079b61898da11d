"""Quota guarantees (borrowing) through the REST API and `vgpuctl --server`: the same changes, the same views
and the same refusals as on the store, and a bad guarantee changes nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
from serverfixtures import RunningServer, server

__all__ = ["server"]  # the fixture, used by name


def _quota(srv: RunningServer, tenant: str) -> Any:
    r = httpx.get(f"{srv.url}/v1/tenants/{tenant}/quota", headers=srv.auth(srv.admin_token), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_guarantees_set_remotely_as_locally(server: RunningServer) -> None:
    args = ("quota", "set", "acme", "--vgpus", "8", "--guarantee-vgpus", "4", "-o", "json")
    remote = server.cli(*args, token=server.admin_token)
    assert remote.returncode == 0, remote.stdout + remote.stderr
    local = server.cli(*args, remote=False)
    assert local.returncode == 0 and json.loads(local.stdout) == json.loads(remote.stdout)
    row = next(r for r in _quota(server, "acme") if r["resource"] == "vgpus" and r["scope"] == "*")
    assert (row["limit"], row["guarantee"]) == (8, 4)
    shown = server.cli("tenant", "usage", "acme", "-o", "json", token=server.admin_token)
    assert json.loads(shown.stdout) == json.loads(server.cli("tenant", "usage", "acme", "-o", "json",
                                                             remote=False).stdout)


def test_a_guarantee_above_its_limit_is_refused_with_nothing_changed(server: RunningServer) -> None:
    before = _quota(server, "acme")
    r = httpx.put(f"{server.url}/v1/tenants/acme/quota", headers=server.auth(server.admin_token), timeout=30,
                  json={"limits": {"vgpus": 2}, "guarantees": {"vgpus": 3}})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem+json"), r.text
    assert "guarantee" in r.json()["reasons"][0]["field"]
    assert _quota(server, "acme") == before
    bad = server.cli("quota", "set", "acme", "--vgpus", "2", "--guarantee-vgpus", "3", token=server.admin_token)
    assert bad.returncode == 2 and "guarantee" in bad.stderr
    assert _quota(server, "acme") == before
    tenant = httpx.put(f"{server.url}/v1/tenants/acme/quota", headers=server.auth(server.tenant_token), timeout=30,
                       json={"limits": {}, "guarantees": {"vgpus": 1}})
    assert tenant.status_code == 403 and _quota(server, "acme") == before
