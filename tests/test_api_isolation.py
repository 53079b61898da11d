"""Tenant isolation over HTTP: every endpoint called with a second tenant's token. Another tenant's object
is 404, exactly as one that does not exist (never its data, never a 403 that confirms it exists); lists,
events, status and operations show only the caller's own; and nothing of the first tenant changes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from apifixtures import DEMO, ApiServer, api_server, problem_of, require_module_ran, wait_operation
from conftest import store_snapshot

VM: dict[str, Any] = {"vgpus": [{"profile": "1g.10gb"}], "vcpus": 2, "memory_mib": 2048}
CALLED: set[str] = set()  # "METHOD /path/template" of every request globex sent
RAN: set[str] = set()  # the tests of this module that ran in this process


@pytest.fixture(autouse=True)
def _ran(request: pytest.FixtureRequest) -> None:
    RAN.add(request.node.originalname)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server where acme has VMs a1 and `same` and a finished delete, globex has its own `same`."""
    with api_server(tmp_path_factory.mktemp("iso")) as srv:
        acme = srv.client("acme")
        made = {}
        for name in ("a1", "same", "gone"):
            r = acme.post("/v1/vms", params={"wait": "30s"}, json={**VM, "name": name})
            assert r.status_code == 201, r.text
            made[name] = r.json()
        r = acme.delete(f"/v1/vms/{made['gone']['id']}")
        delete_op = wait_operation(acme, r.headers["location"])
        assert delete_op["state"] == "succeeded"
        create_op = acme.get("/v1/operations", params={"state": "succeeded"}).json()[-1]
        r = srv.client("globex").post("/v1/vms", params={"wait": "30s"}, json={**VM, "name": "same"})
        assert r.status_code == 201
        doc = srv.client("admin").get("/openapi.json").json()
        yield {"srv": srv, "a1": made["a1"], "a_same": made["same"], "g_same": r.json(),
               "ops": [create_op, delete_op], "doc": doc}


@pytest.fixture
def globex(world: dict[str, Any]) -> httpx.Client:
    """globex's client, recording which operations of the schema it called."""
    rxs = []
    for path, item in world["doc"]["paths"].items():
        rx = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")
        rxs.extend((m.upper(), path, rx) for m in item)

    def record(request: httpx.Request) -> None:
        for method, path, rx in rxs:
            if method == request.method and rx.match(request.url.path):
                CALLED.add(f"{method} {path}")

    c: httpx.Client = world["srv"].client("globex")
    c.event_hooks["request"].append(record)
    return c


def _snapshot(srv: ApiServer) -> dict[str, Any]:
    with srv.ctl() as c:
        snap = store_snapshot(c)
    snap.pop("events")  # globex's own calls are audited (refusals); acme's objects are the rest
    with srv.client("admin") as admin:
        snap["operations"] = admin.get("/v1/operations", params={"limit": 1000}).json()
    return snap


def _same_404(other: httpx.Response, missing: httpx.Response, secret: str, missing_ref: str) -> None:
    """`other` (acme's object) and `missing` (none) are the same 404 but for the name asked, and `other`
    holds nothing of the object but the reference the caller gave."""
    a = problem_of(other, 404, "not_found")
    b = problem_of(missing, 404, "not_found")
    assert a["reasons"][0].keys() == b["reasons"][0].keys()
    assert other.text.replace(secret, "REF") == missing.text.replace(missing_ref, "REF"), (other.text, missing.text)


def test_another_tenants_vm_is_404_everywhere(world: dict[str, Any], globex: httpx.Client) -> None:
    srv: ApiServer = world["srv"]
    a1 = world["a1"]
    before = _snapshot(srv)
    nobody = "0" * 8 + a1["id"][8:]  # an id of the same shape that no VM has
    for ref in (a1["id"], a1["id"][:8], "a1"):
        missing = nobody if ref != "a1" else "zz9"
        if ref == a1["id"][:8]:
            missing = nobody[:8]
        _same_404(globex.get(f"/v1/vms/{ref}"), globex.get(f"/v1/vms/{missing}"), ref, missing)
        _same_404(globex.get(f"/v1/vms/{ref}/xml"), globex.get(f"/v1/vms/{missing}/xml"), ref, missing)
        _same_404(globex.post(f"/v1/vms/{ref}/stop", json={"force": True}),
                  globex.post(f"/v1/vms/{missing}/stop", json={"force": True}), ref, missing)
        _same_404(globex.post(f"/v1/vms/{ref}/start"), globex.post(f"/v1/vms/{missing}/start"), ref, missing)
        _same_404(globex.delete(f"/v1/vms/{ref}"), globex.delete(f"/v1/vms/{missing}"), ref, missing)
        _same_404(globex.delete(f"/v1/vms/{ref}", params={"wait": "5s"}, headers={"If-Match": '"1"'}),
                  globex.delete(f"/v1/vms/{missing}", params={"wait": "5s"}, headers={"If-Match": '"1"'}),
                  ref, missing)
    for r in (globex.get(f"/v1/vms/{a1['id']}"), globex.get("/v1/vms/a1")):
        assert a1["host"] not in r.text and "1g.10gb" not in r.text and a1["devices"][0]["id"] not in r.text
    assert _snapshot(srv) == before
    assert srv.client("acme").get(f"/v1/vms/{a1['id']}").json() == a1


def test_names_resolve_to_the_callers_own_vm(world: dict[str, Any], globex: httpx.Client) -> None:
    r = globex.get("/v1/vms/same")
    assert r.status_code == 200 and r.json() == world["g_same"] and r.json()["tenant"] == "globex"
    assert globex.get(f"/v1/vms/{world['a_same']['id']}").status_code == 404


def test_lists_show_only_the_callers_own(world: dict[str, Any], globex: httpx.Client) -> None:
    page = globex.get("/v1/vms").json()
    assert [(v["tenant"], v["name"]) for v in page["items"]] == [("globex", "same")] and page["total"] == 1
    assert globex.get("/v1/vms", params={"tenant": "globex", "pool": "inference"}).json()["total"] == 1
    _same_404(globex.get("/v1/vms", params={"tenant": "acme"}), globex.get("/v1/vms", params={"tenant": "zz9"}),
              "acme", "zz9")
    assert [t["name"] for t in globex.get("/v1/tenants").json()] == ["globex"]
    ops = globex.get("/v1/operations", params={"limit": 1000}).json()
    assert ops and {o["tenant"] for o in ops} == {"globex"}
    assert not {o["id"] for o in world["ops"]} & {o["id"] for o in ops}
    events = globex.get("/v1/events", params={"limit": 10000}).json()
    assert events and {e["tenant"] for e in events} == {"globex"}
    assert not any("a1" in str(e["params"]) for e in events)
    _same_404(globex.get("/v1/events", params={"tenant": "acme"}), globex.get("/v1/events", params={"tenant": "zz9"}),
              "acme", "zz9")
    status = globex.get("/v1/status", params={"gpus": "true"}).json()
    assert status["summary"] is None and status["gpus"] == [] and status["page"]["total"] == 0
    assert [t["name"] for t in status["tenants"]] == ["globex"]
    assert globex.get("/v1/pools").status_code == 200 and globex.get("/v1/profiles").status_code == 200


def test_another_tenants_operations_are_404(world: dict[str, Any], globex: httpx.Client) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    for op in world["ops"]:
        _same_404(globex.get(f"/v1/operations/{op['id']}"), globex.get(f"/v1/operations/{missing}"),
                  op["id"], missing)
        _same_404(globex.get(f"/v1/operations/{op['id']}", params={"wait": "2s"}),
                  globex.get(f"/v1/operations/{missing}", params={"wait": "2s"}), op["id"], missing)


def test_another_tenant_is_404_and_admin_commands_are_403_alike(world: dict[str, Any],
                                                                 globex: httpx.Client) -> None:
    srv: ApiServer = world["srv"]
    before = _snapshot(srv)
    _same_404(globex.get("/v1/tenants/acme"), globex.get("/v1/tenants/zz9"), "acme", "zz9")
    _same_404(globex.get("/v1/tenants/acme/quota"), globex.get("/v1/tenants/zz9/quota"), "acme", "zz9")
    for body in ({**VM, "name": "intrude", "tenant": "acme"},):
        _same_404(globex.post("/v1/vms", json=body), globex.post("/v1/vms", json={**body, "tenant": "zz9"}),
                  "acme", "zz9")
        _same_404(globex.post("/v1/vms", json=body, params={"wait": "5s"}),
                  globex.post("/v1/vms", json={**body, "tenant": "zz9"}, params={"wait": "5s"}), "acme", "zz9")
        _same_404(globex.post("/v1/placements", json=body),
                  globex.post("/v1/placements", json={**body, "tenant": "zz9"}), "acme", "zz9")
        if "/v1/placements/candidates" in world["doc"]["paths"]:
            _same_404(globex.post("/v1/placements/candidates", json=body),
                      globex.post("/v1/placements/candidates", json={**body, "tenant": "zz9"}), "acme", "zz9")
    for method, url, kw in [("DELETE", "/v1/tenants/{t}", {}), ("POST", "/v1/tenants/{t}/token", {}),
                            ("DELETE", "/v1/tenants/{t}/token", {}),
                            ("PUT", "/v1/tenants/{t}/quota", {"json": {"limits": {"vms": 0}}})]:
        a = globex.request(method, url.format(t="acme"), **kw)
        b = globex.request(method, url.format(t="zz9"), **kw)
        problem_of(a, 403, "permission_denied")
        assert a.text == b.text, (a.text, b.text)  # the refusal is about the role, not about the tenant
    for method, url, kw in [("GET", "/v1/inventory", {}), ("GET", "/v1/hosts", {}), ("GET", "/v1/tokens", {}),
                            ("GET", "/v1/doctor", {}), ("GET", "/metrics", {}),
                            ("POST", "/v1/reconcile", {"json": {"fix": True}}),
                            ("POST", "/v1/inventory", {"content": DEMO.read_bytes(),
                                                       "headers": {"Content-Type": "application/yaml"}}),
                            ("PUT", "/v1/hosts/kvm-h100-01/state", {"json": {"state": "down"}}),
                            ("POST", "/v1/tenants", {"json": {"name": "acme2"}}),
                            ("POST", "/v1/tokens", {"json": {"name": "mine", "role": "admin"}}),
                            ("DELETE", "/v1/tokens/anything", {})]:
        problem_of(globex.request(method, url, **kw), 403, "permission_denied")
    r = globex.get("/readyz")
    assert r.status_code in (200, 503) and "acme" not in r.text
    assert _snapshot(srv) == before


def test_idempotency_keys_do_not_cross_tenants(world: dict[str, Any], globex: httpx.Client) -> None:
    srv: ApiServer = world["srv"]
    acme = srv.client("acme")
    ra = acme.post("/v1/vms", json={**VM, "name": "keyed"}, headers={"Idempotency-Key": "k-iso"})
    rg = globex.post("/v1/vms", json={**VM, "name": "keyed", "vcpus": 3}, headers={"Idempotency-Key": "k-iso"})
    assert (ra.status_code, rg.status_code) == (202, 202) and "idempotent-replayed" not in rg.headers
    assert rg.json()["tenant"] == "globex" and rg.json()["request"]["vcpus"] == 3
    assert "acme" not in rg.text and ra.json()["id"] not in rg.text
    assert wait_operation(globex, rg.headers["location"])["result"]["tenant"] == "globex"
    assert wait_operation(acme, ra.headers["location"])["result"]["tenant"] == "acme"


def test_scheduling_shows_only_the_callers_own(world: dict[str, Any], globex: httpx.Client) -> None:
    """The queue, tenants' scheduling settings, fair share and preemption previews: acme's are 404 to globex
    as if they did not exist, and the admin's scheduling commands are the same 403 whatever they name."""
    srv: ApiServer = world["srv"]
    acme = srv.client("acme")
    big = {**VM, "name": "queued-big", "vgpus": [{"profile": "A100-80GB", "count": 2}], "queue": True}
    r = acme.post("/v1/vms", json=big)  # two whole A100s on one host: none has them, so it waits
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 20
    while not (queued := [q for q in acme.get("/v1/queue").json() if q["name"] == "queued-big"]):
        assert time.monotonic() < deadline, acme.get(r.headers["location"]).json()
        time.sleep(0.1)
    op = queued[0]["operation"]
    try:
        missing = "00000000-0000-4000-8000-000000000000"
        assert globex.get("/v1/queue").json() == []
        _same_404(globex.get(f"/v1/queue/{op}"), globex.get(f"/v1/queue/{missing}"), op, missing)
        _same_404(globex.delete(f"/v1/queue/{op}"), globex.delete(f"/v1/queue/{missing}"), op, missing)
        _same_404(globex.get("/v1/queue", params={"tenant": "acme"}),
                  globex.get("/v1/queue", params={"tenant": "zz9"}), "acme", "zz9")
        _same_404(globex.get("/v1/tenants/acme/scheduling"), globex.get("/v1/tenants/zz9/scheduling"), "acme", "zz9")
        assert globex.get("/v1/tenants/globex/scheduling").json()["tenant"] == "globex"
        preview = {**VM, "name": "p", "tenant": "acme"}
        _same_404(globex.post("/v1/scheduling/preview", json=preview),
                  globex.post("/v1/scheduling/preview", json={**preview, "tenant": "zz9"}), "acme", "zz9")
        share = globex.get("/v1/scheduling/share")
        assert share.status_code == 200 and "acme" not in share.text, share.text
        pre = globex.get("/v1/scheduling/preemptions")
        assert pre.status_code == 200 and "acme" not in pre.text
        for url in ("/v1/priority-classes", "/v1/scheduling/settings"):
            assert globex.get(url).status_code == 200
        for method, url, kw in [("PUT", "/v1/tenants/{t}/scheduling", {"json": {"shares": 5}})]:
            a = globex.request(method, url.format(t="acme"), **kw)
            b = globex.request(method, url.format(t="zz9"), **kw)
            problem_of(a, 403, "permission_denied")
            assert a.text == b.text
        for method, url, kw in [("POST", "/v1/queue/admit", {}), ("PUT", "/v1/accounts/research", {"json": {}}),
                                ("DELETE", "/v1/accounts/research", {}),
                                ("POST", "/v1/priority-classes", {"json": {"name": "mine", "value": 9}}),
                                ("DELETE", "/v1/priority-classes/batch", {}),
                                ("PUT", "/v1/scheduling/settings", {"json": {"grace_s": 1}})]:
            problem_of(globex.request(method, url, **kw), 403, "permission_denied")
        assert [q["operation"] for q in acme.get("/v1/queue").json()] == [op]  # untouched by globex
    finally:
        assert acme.delete(f"/v1/queue/{op}").status_code == 204


def test_zz_every_endpoint_was_called_by_the_second_tenant(request: pytest.FixtureRequest,
                                                          world: dict[str, Any]) -> None:
    """Runs last: every operation of the OpenAPI document was called with globex's token."""
    require_module_ran(request, RAN, "globex")
    wanted = {f"{m.upper()} {p}" for p, item in world["doc"]["paths"].items() for m in item} - {"GET /healthz"}
    assert wanted - CALLED == set()
