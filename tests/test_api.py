"""The REST API against a real `vgpuctl serve` on loopback, over HTTP: every endpoint, problem details with
the CLI's codes and reasons, credentials and roles, asynchronous operations, ETags and If-Match, the
Idempotency-Key, and bad input that changes nothing."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from apifixtures import DEMO, READER_TOKEN_NAME, ApiServer, api_server, problem_of, require_module_ran, wait_operation
from conftest import store_snapshot
from typer.testing import CliRunner

VM_BODY: dict[str, Any] = {"name": "j1", "vgpus": [{"profile": "1g.10gb"}], "vcpus": 2, "memory_mib": 2048}
CALLED: set[tuple[str, str]] = set()  # (method, path template) of every request the tests sent
RAN: set[str] = set()  # the tests of this module that ran in this process


@pytest.fixture(autouse=True)
def _ran(request: pytest.FixtureRequest) -> None:
    RAN.add(request.node.originalname)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One server for the module: the demo fleet, tenants acme and globex, an admin and a reader token."""
    with api_server(tmp_path_factory.mktemp("api")) as server:
        yield server


@pytest.fixture(scope="module")
def templates(srv: ApiServer) -> list[tuple[str, re.Pattern[str]]]:
    """Each operation of the server's OpenAPI document as (METHOD path-template, a regex matching its paths)."""
    doc = httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": f"Bearer {srv.tokens['admin']}"}).json()
    out = []
    for path, item in doc["paths"].items():
        rx = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")
        out.extend((f"{m.upper()} {path}", rx) for m in item)
    return out


@pytest.fixture
def http(srv: ApiServer, templates: list[tuple[str, re.Pattern[str]]]) -> Any:
    """A factory of clients (as `who`) that record which operations of the schema answered with success."""
    def record(response: httpx.Response) -> None:
        if response.status_code >= 300:
            return
        for name, rx in templates:
            method, _, _path = name.partition(" ")
            if method == response.request.method and rx.match(response.request.url.path):
                CALLED.add((method, _path))

    def make(who: str | None = None, token: str | None = None) -> httpx.Client:
        c = srv.client(who, token)
        c.event_hooks["response"].append(record)
        return c
    return make


_tenants = iter(range(1, 10**6))


def new_tenant(srv: ApiServer, http: Any, quota: dict[str, int] | None = None) -> tuple[str, httpx.Client]:
    """A fresh tenant (its name and a client acting as it), so that tests do not share usage."""
    name = f"t{next(_tenants)}"
    srv.add_tenant(name, quota)
    return name, http(name)


def create_vm(client: httpx.Client, body: dict[str, Any] | None = None, **params: str) -> httpx.Response:
    """POST /v1/vms with `body` (VM_BODY by default)."""
    return client.post("/v1/vms", json=body or VM_BODY, params=params)


def created(client: httpx.Client, name: str = "j1", **extra: Any) -> dict[str, Any]:
    """A VM made with ?wait (checked: 201 with the VM)."""
    r = create_vm(client, {**VM_BODY, "name": name, **extra}, wait="30s")
    assert r.status_code == 201, r.text
    vm: dict[str, Any] = r.json()
    return vm


def operations(srv: ApiServer) -> list[dict[str, Any]]:
    """Every operation (as the admin sees them)."""
    with srv.client("admin") as c:
        r = c.get("/v1/operations", params={"limit": 1000})
    assert r.status_code == 200
    ops: list[dict[str, Any]] = r.json()
    return ops


def snapshot(srv: ApiServer) -> dict[str, Any]:
    """The store's state (inventory, tenants, quotas, VMs, devices, GPUs, hosts, events) and operations."""
    with srv.ctl() as c:
        snap = store_snapshot(c)
        snap["tokens"] = c.list_api_tokens()
    snap["operations"] = operations(srv)
    return snap


# -- health and the schema ----------------------------------------------------------------------------------


def test_healthz_is_the_only_anonymous_path(srv: ApiServer, http: Any,
                                            templates: list[tuple[str, re.Pattern[str]]]) -> None:
    anon = http()
    r = anon.get("/healthz")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert problem_of(anon.get("/openapi.json"), 401, "unauthenticated")
    for name, _ in templates:
        method, _, path = name.partition(" ")
        if path == "/healthz":
            continue
        url = path.replace("{ref}", "x1").replace("{name}", "acme").replace("{op_id}", "x2")
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer  \t  x"},
                        {"Authorization": "Bearer vgt_wrong"}, {"Authorization": "Basic YWRtaW46YWRtaW4="},
                        {"Authorization": ""}):
            body = {"content": b"{}", "headers": {**headers, "Content-Type": "application/json"}}
            r = anon.request(method, url, **body)  # type: ignore[arg-type]
            p = problem_of(r, 401, "unauthenticated")
            assert r.headers["www-authenticate"] == "Bearer", (name, headers)
            assert "token" in p["detail"].lower() or "authorization" in p["detail"].lower(), p


def test_the_token_is_checked_before_the_request_is_read(srv: ApiServer, http: Any) -> None:
    anon, wrong = http(), http(token="vgt_wrong")
    for client in (anon, wrong):
        for r in (client.post("/v1/vms", content=b"{not json", headers={"Content-Type": "application/json"}),
                  client.post("/v1/vms", json={**VM_BODY, "name": "x\x00"}),
                  client.get("/v1/vms/a%00b"), client.get("/v1/vms", params={"limit": "ten"}),
                  client.post("/v1/vms", json=VM_BODY, headers={"Idempotency-Key": ""}),
                  client.get("/v1/no-such-thing"), client.delete("/v1/pools")):
            problem_of(r, 401, "unauthenticated")


def test_readyz_and_metrics(srv: ApiServer, http: Any) -> None:
    deadline = time.monotonic() + 20
    while True:  # the leader is known once the loop has run once
        r = http("reader").get("/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    body = r.json()
    assert r.status_code == 200 and body["ok"] is True and body["store"] is True and body["leader"], body
    m = http("reader").get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert "vgpuctl_gpus{" in m.text and "vgpu_server_operations_in_flight" in m.text
    assert http("admin").get("/metrics").status_code == 200
    problem_of(http("acme").get("/metrics"), 403, "permission_denied")


# -- reads ----------------------------------------------------------------------------------------------------


def test_catalog_pools_inventory_hosts(srv: ApiServer, http: Any) -> None:
    admin = http("admin")
    profiles = admin.get("/v1/profiles", params={"model": "h100-80gb"}).json()
    assert profiles and all(p["model"] == "H100-80GB" for p in profiles)
    assert "3g.40gb" in {p["name"] for p in profiles}
    pools = {p["name"]: p for p in http("acme").get("/v1/pools").json()}
    assert set(pools) == {"training", "inference", "workstations"} and pools["inference"]["gpus"] == 3
    inv = http("reader").get("/v1/inventory").json()
    assert [h["name"] for h in inv["hosts"]] == ["kvm-a100-01", "kvm-h100-01", "kvm-l40s-01"]
    assert all(h["simulated"] for h in inv["hosts"])
    hosts = http("reader").get("/v1/hosts").json()
    assert hosts == inv["hosts"]
    problem_of(http("acme").get("/v1/inventory"), 403, "permission_denied")
    problem_of(http("acme").get("/v1/hosts"), 403, "permission_denied")
    r = admin.delete("/v1/pools")
    problem_of(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET"
    problem_of(admin.get("/v1/no-such-thing"), 404, "not_found")
    p = problem_of(admin.get("/v1/profiles", params={"model": "no-such-gpu"}), 400, "catalog")
    assert p["reasons"] == [{"field": "model", "value": "no-such-gpu"}]


def test_reader_reads_everything(srv: ApiServer, http: Any) -> None:
    a = created(http("acme"), "reader-sees-a")
    g = created(http("globex"), "reader-sees-g")
    reader = http("reader")
    names = {(v["tenant"], v["name"]) for v in reader.get("/v1/vms").json()["items"]}
    assert {("acme", "reader-sees-a"), ("globex", "reader-sees-g")} <= names
    assert reader.get(f"/v1/vms/{a['id']}").json()["id"] == a["id"]
    assert reader.get(f"/v1/vms/{g['id']}/xml").text.startswith("<domain")
    assert {"acme", "globex"} <= {t["name"] for t in reader.get("/v1/tenants").json()}
    assert reader.get("/v1/tenants/globex").json()["name"] == "globex"
    assert reader.get("/v1/tenants/globex/quota").status_code == 200
    status = reader.get("/v1/status", params={"gpus": "true", "limit": 3}).json()
    assert status["summary"] is not None and len(status["gpus"]) == 3 and status["page"]["total"] == 9
    assert {"acme", "globex"} <= {t["name"] for t in status["tenants"]}
    events = reader.get("/v1/events").json()
    assert {"acme", "globex"} <= {e["tenant"] for e in events}
    assert {o["tenant"] for o in reader.get("/v1/operations").json()} >= {"acme", "globex"}
    placement = reader.post("/v1/placements", json={**VM_BODY, "tenant": "acme", "name": "dry"})
    assert placement.status_code == 200 and placement.json()["devices"], placement.text


def test_reader_gets_403_on_every_write_and_nothing_changes(srv: ApiServer, http: Any) -> None:
    vm = created(http("acme"), "reader-target")
    reader = http("reader")
    before = snapshot(srv)
    writes = [
        ("POST", "/v1/vms", {"json": {**VM_BODY, "tenant": "acme", "name": "by-reader"}}),
        ("POST", "/v1/vms?wait=5s", {"json": {**VM_BODY, "tenant": "acme", "name": "by-reader"}}),
        ("DELETE", f"/v1/vms/{vm['id']}", {}),
        ("POST", f"/v1/vms/{vm['id']}/stop", {"json": {"force": True}}),
        ("POST", f"/v1/vms/{vm['id']}/start", {}),
        ("POST", "/v1/inventory?dry_run=false", {"content": DEMO.read_bytes(),
                                                  "headers": {"Content-Type": "application/yaml"}}),
        ("PUT", "/v1/hosts/kvm-l40s-01/state", {"json": {"state": "down"}}),
        ("POST", "/v1/tenants", {"json": {"name": "by-reader"}}),
        ("DELETE", "/v1/tenants/globex", {}),
        ("POST", "/v1/tenants/acme/token", {}),
        ("DELETE", "/v1/tenants/acme/token", {}),
        ("PUT", "/v1/tenants/acme/quota", {"json": {"limits": {"vms": 0}}}),
        ("POST", "/v1/tokens", {"json": {"name": "by-reader", "role": "admin"}}),
        ("DELETE", f"/v1/tokens/{READER_TOKEN_NAME}", {}),
        ("POST", "/v1/reconcile", {"json": {"fix": True}}),
    ]
    for method, url, kw in writes:
        p = problem_of(reader.request(method, url, **kw), 403, "permission_denied")
        assert p["reasons"] == [{"field": "role", "value": "reader"}], (method, url, p)
    from vgpu_ctl import Controller
    from vgpu_ctl.errors import PermissionDenied
    with Controller(srv.store_url, token=srv.tokens["reader"], state_path=srv.state) as as_reader:
        for call in (lambda: as_reader.request_vm("acme", "by-reader", "1g.10gb", vcpus=1, memory_mib=1024),
                     lambda: as_reader.release_vm(vm["id"]), lambda: as_reader.stop_vm(vm["id"]),
                     lambda: as_reader.start_vm(vm["id"])):
            with pytest.raises(PermissionDenied):
                call()
    assert snapshot(srv) == before


# -- errors are problem details with the CLI's code and reasons -----------------------------------------------


def _cli_error(srv: ApiServer, who: str, *args: str) -> dict[str, Any]:
    from vgpu_ctl.cli.main import app
    env = {"VGPU_CTL_DATABASE_URL": srv.store_url, "VGPU_CTL_STATE_DIR": str(srv.state), "VGPU_CTL_TOKEN": None,
           "VGPU_CTL_SERVER": None}
    result = CliRunner().invoke(app, ["--token", srv.tokens[who], *args, "--json"], env=env)
    assert result.exit_code != 0, result.output
    err: dict[str, Any] = json.loads(result.stdout)["error"]
    return err


def test_errors_carry_the_cli_code_and_reasons(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http, {"vgpus": 1})
    p = problem_of(client.get("/v1/vms/nope"), 404, "not_found")
    cli = _cli_error(srv, name, "vm", "show", "nope")
    assert (p["code"], p["message"], p["reasons"]) == (cli["code"], cli["message"], cli["reasons"])

    over = {**VM_BODY, "name": "big", "vgpus": [{"profile": "1g.10gb", "count": 2}]}
    p = problem_of(client.post("/v1/placements", json=over), 409, "quota_exceeded")
    cli = _cli_error(srv, name, "vm", "create", "--tenant", name, "--name", "big", "--profile", "1g.10gb",
                     "--count", "2", "--vcpus", "2", "--memory", "2048MiB", "--dry-run")
    assert (p["code"], p["reasons"]) == (cli["code"], cli["reasons"])
    assert p["reasons"][0]["resource"] == "vgpus" and p["reasons"][0]["limit"] == 1

    p = problem_of(client.post("/v1/placements", json={**VM_BODY, "vcpus": 0}), 400, "invalid")
    cli = _cli_error(srv, name, "vm", "create", "--tenant", name, "--name", "j1", "--profile", "1g.10gb",
                     "--vcpus", "0", "--memory", "2048MiB", "--dry-run")
    assert (p["code"], p["message"], p["reasons"]) == (cli["code"], cli["message"], cli["reasons"])


def test_placement_candidates_are_ranked_and_the_first_is_the_dry_run(
        srv: ApiServer, http: Any, templates: list[tuple[str, re.Pattern[str]]]) -> None:
    if "POST /v1/placements/candidates" not in {name for name, _ in templates}:
        pytest.skip("this server has no /v1/placements/candidates")
    _name, client = new_tenant(srv, http)
    before = snapshot(srv)
    r = client.post("/v1/placements/candidates", json=VM_BODY)
    assert r.status_code == 200, r.text
    rows = r.json()
    ranked = [c for c in rows if c["rank"] is not None]
    assert ranked and ranked[0]["rank"] == 1 and all(c["why_not"] is None for c in ranked)
    assert all(d["profile"] == "1g.10gb" for c in ranked for d in c["devices"])
    dry = client.post("/v1/placements", json=VM_BODY).json()
    assert (ranked[0]["pool"], ranked[0]["host"]) == (dry["pool"], dry["host"])
    assert [d["gpu"] for d in ranked[0]["devices"]] == [d["gpu"] for d in dry["devices"]]
    problem_of(client.post("/v1/placements/candidates", json={**VM_BODY, "tenant": "globex"}), 404, "not_found")
    problem_of(client.post("/v1/placements/candidates", json={**VM_BODY, "vcpus": 0}), 400, "invalid")
    assert snapshot(srv) == before


# -- VMs and operations -----------------------------------------------------------------------------------------


def test_create_is_202_with_an_operation_that_ends_with_the_vm(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http)
    r = create_vm(client)
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    op = r.json()
    assert location == f"/v1/operations/{op['id']}"
    assert op["kind"] == "vm.create" and op["state"] in ("pending", "running") and op["tenant"] == name
    assert op["request"]["name"] == "j1" and op["result"] is None and op["error"] is None
    done = wait_operation(client, location)
    assert done["state"] == "succeeded" and done["error"] is None and done["finished_at"], done
    vm = done["result"]
    assert (vm["name"], vm["tenant"], vm["state"], vm["vcpus"], vm["memory_mib"]) == ("j1", name, "running", 2, 2048)
    assert done["vm_id"] == vm["id"] and [d["profile"] for d in vm["devices"]] == ["1g.10gb"]
    got = client.get(f"/v1/vms/{vm['id']}")
    assert got.status_code == 200 and got.json() == vm
    assert got.headers["etag"] == f'"{vm["generation"]}"'
    assert client.get("/v1/vms/j1").json()["id"] == vm["id"]
    assert client.get(f"/v1/vms/{vm['id'][:8]}").json()["id"] == vm["id"]
    waited = client.get(location, params={"wait": "1s"})
    assert waited.status_code == 200 and waited.json() == done
    listed = client.get("/v1/operations", params={"state": "succeeded"}).json()
    assert [o["id"] for o in listed] == [op["id"]]


def test_create_with_wait_is_201_with_the_vm(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http)
    r = create_vm(client, wait="30s")
    assert r.status_code == 201, r.text
    vm = r.json()
    assert r.headers["location"] == f"/v1/vms/{vm['id']}"
    assert r.headers["etag"] == f'"{vm["generation"]}"'
    op = client.get(r.headers["operation-location"]).json()
    assert op["state"] == "succeeded" and op["result"] == vm
    assert vm["state"] == "running" and vm["tenant"] == name
    assert client.get(f"/v1/vms/{vm['id']}").json() == vm
    usage = {q["resource"]: q["used"] for q in client.get(f"/v1/tenants/{name}/quota").json()}
    assert usage["vms"] == 1 and usage["vgpus"] == 1 and usage["vcpus"] == 2


def test_refusals_fail_the_operation_with_code_and_reasons(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http, {"vgpus": 1})
    before = snapshot(srv)
    two = {**VM_BODY, "vgpus": [{"profile": "1g.10gb", "count": 2}]}
    r = create_vm(client, two)
    assert r.status_code == 202
    op = wait_operation(client, r.headers["location"])
    assert op["state"] == "failed" and op["result"] is None and op["vm_id"] is None
    assert op["error"]["code"] == "quota_exceeded"
    assert op["error"]["reasons"] == [{"kind": "quota", "tenant": name, "scope": "*", "resource": "vgpus",
                                       "limit": 1, "used": 0, "requested": 2}]
    r = create_vm(client, two, wait="30s")
    p = problem_of(r, 409, "quota_exceeded")
    assert p["reasons"] == op["error"]["reasons"]
    assert r.headers["location"].startswith("/v1/operations/")
    failed = client.get(r.headers["location"]).json()
    assert failed["state"] == "failed" and failed["error"]["code"] == "quota_exceeded"

    huge = {**VM_BODY, "name": "huge", "vcpus": 4096}
    p = problem_of(create_vm(client, huge, wait="30s"), 409, "no_capacity")
    assert p["reasons"] and {r["kind"] for r in p["reasons"]} == {"capacity"}
    assert {r["pool"] for r in p["reasons"]} == {"inference", "training"}  # both offer 1g.10gb
    assert all(set(r["counts"]) == {"vcpus"} for r in p["reasons"]), p["reasons"]
    after = snapshot(srv)
    for key in ("vms", "devices", "gpus", "hosts", "scoped", "inventory"):
        assert after[key] == before[key], key
    assert [t for t in after["tenants"] if t["name"] == name] == [t for t in before["tenants"] if t["name"] == name]
    refusals = [e for e in after["events"][len(before["events"]):]]
    assert [(e["action"], e["result"], e["error"]) for e in refusals] == [
        ("vm.create", "refused", "quota_exceeded")] * 2 + [("vm.create", "refused", "no_capacity")]


def test_waits_do_not_hold_the_server(srv: ApiServer, http: Any) -> None:
    """More callers waiting on an operation (?wait) than the server has threads: others are still answered
    at once, and each wait ends after its time with the operation as it is."""
    from concurrent.futures import ThreadPoolExecutor

    from vgpu_ctl.service import operations as ops
    from vgpu_ctl.service.principals import Principal
    name, client = new_tenant(srv, http)
    with srv.ctl() as c, c.tx() as conn:  # an operation another replica holds and does not finish
        t_id = c._tenant_id(conn, name)
        stuck = ops.submit(conn, Principal(f"tenant:{name}", t_id, name, "tenant"), "vm.create",
                           {**VM_BODY, "tenant": name}, tenant_id=t_id, vm_id=None, holder="elsewhere:1:stuck",
                           lease_seconds=600)
    headers = {"Authorization": f"Bearer {srv.tokens[name]}"}

    def wait() -> httpx.Response:
        return httpx.get(f"{srv.url}/v1/operations/{stuck.id}", params={"wait": "4s"}, headers=headers,
                         timeout=60)

    with ThreadPoolExecutor(64) as pool:
        waits = [pool.submit(wait) for _ in range(64)]
        time.sleep(1.0)
        started = time.monotonic()
        r = client.get("/v1/pools")
        answered = time.monotonic() - started
        results = [f.result() for f in waits]
    assert r.status_code == 200 and answered < 1.5, answered
    assert {(x.status_code, x.json()["state"]) for x in results} == {(200, "running")}


def test_delete_is_202_then_the_vm_is_gone_and_quota_freed(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http, {"vms": 1})
    vm = created(client)
    r = client.delete(f"/v1/vms/{vm['id']}")
    assert r.status_code == 202, r.text
    op = wait_operation(client, r.headers["location"])
    assert (op["kind"], op["state"], op["vm_id"], op["result"]) == ("vm.delete", "succeeded", vm["id"],
                                                                     {"deleted": vm["id"]})
    problem_of(client.get(f"/v1/vms/{vm['id']}"), 404, "not_found")
    usage = {q["resource"]: q["used"] for q in client.get(f"/v1/tenants/{name}/quota").json()}
    assert usage["vms"] == 0 and usage["vgpus"] == 0 and usage["framebuffer_mib"] == 0
    again = created(client)  # the freed quota takes a VM again
    r = client.delete(f"/v1/vms/{again['id']}", params={"wait": "30s"})
    assert r.status_code == 200 and r.json()["state"] == "succeeded", r.text
    problem_of(client.get(f"/v1/vms/{again['id']}"), 404, "not_found")
    problem_of(client.delete(f"/v1/vms/{again['id']}"), 404, "not_found")


def test_stop_start_xml_and_list(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http)
    vm = created(client, "s1")
    created(client, "s2")
    xml = client.get(f"/v1/vms/{vm['id']}/xml")
    assert xml.status_code == 200 and xml.headers["content-type"].startswith("text/plain")
    assert f"<uuid>{vm['domain_uuid']}</uuid>" in xml.text
    r = client.post(f"/v1/vms/{vm['id']}/stop", json={"force": True})
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    assert r.headers["etag"] == f'"{r.json()["generation"]}"' and r.json()["generation"] > vm["generation"]
    problem_of(client.post(f"/v1/vms/{vm['id']}/stop"), 409, "conflict")
    r = client.post(f"/v1/vms/{vm['id']}/start")
    assert r.status_code == 200 and r.json()["state"] == "running"
    page = client.get("/v1/vms", params={"limit": 1, "offset": 1}).json()
    assert (page["total"], page["offset"], page["limit"]) == (2, 1, 1)
    assert [v["name"] for v in page["items"]] == ["s2"]
    assert client.get("/v1/vms", params={"state": "stopped"}).json()["total"] == 0
    assert client.get("/v1/vms", params={"tenant": name, "pool": "inference"}).json()["total"] == 2
    assert http("admin").get("/v1/vms", params={"tenant": name, "host": "kvm-a100-01"}).json()["items"] == []


# -- ETags and If-Match -------------------------------------------------------------------------------------------


def test_etags_and_if_match(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http)
    admin = http("admin")
    vm = created(client)
    tag = client.get(f"/v1/vms/{vm['id']}").headers["etag"]
    assert tag == f'"{vm["generation"]}"'
    t = admin.get(f"/v1/tenants/{name}")
    assert t.headers["etag"] == f'"{t.json()["generation"]}"'
    q = admin.get(f"/v1/tenants/{name}/quota")
    assert q.headers["etag"] == t.headers["etag"]
    stale_vm = f'"{vm["generation"] - 1}"'
    stale_tenant = f'"{t.json()["generation"] - 1}"'
    before = snapshot(srv)
    for r in (client.post(f"/v1/vms/{vm['id']}/stop", headers={"If-Match": stale_vm}),
              client.delete(f"/v1/vms/{vm['id']}", headers={"If-Match": stale_vm}),
              admin.put(f"/v1/tenants/{name}/quota", json={"limits": {"vms": 5}},
                        headers={"If-Match": stale_tenant}),
              admin.delete(f"/v1/tenants/{name}", headers={"If-Match": stale_tenant})):
        p = problem_of(r, 412, "precondition_failed")
        assert p["reasons"], p
    assert snapshot(srv) == before

    r = client.post(f"/v1/vms/{vm['id']}/stop", headers={"If-Match": tag}, json={"force": True})
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    problem_of(client.post(f"/v1/vms/{vm['id']}/start", headers={"If-Match": tag}), 412, "precondition_failed")
    r = client.post(f"/v1/vms/{vm['id']}/start", headers={"If-Match": r.headers["etag"]})
    assert r.status_code == 200 and r.json()["state"] == "running"
    r = admin.put(f"/v1/tenants/{name}/quota", json={"limits": {"vms": 5}}, headers={"If-Match": t.headers["etag"]})
    assert r.status_code == 200 and r.json() == {"vms": 5}
    assert r.headers["etag"] != t.headers["etag"]
    assert r.headers["etag"] == admin.get(f"/v1/tenants/{name}").headers["etag"]
    assert {q["resource"]: q["limit"] for q in admin.get(f"/v1/tenants/{name}/quota").json()}["vms"] == 5
    current = client.get(f"/v1/vms/{vm['id']}").headers["etag"]
    r = client.delete(f"/v1/vms/{vm['id']}", headers={"If-Match": current}, params={"wait": "30s"})
    assert r.status_code == 200 and r.json()["state"] == "succeeded", r.text
    r = admin.delete(f"/v1/tenants/{name}", headers={"If-Match": admin.get(f"/v1/tenants/{name}").headers["etag"]})
    assert r.status_code == 204 and r.content == b""
    problem_of(admin.get(f"/v1/tenants/{name}"), 404, "not_found")


def test_malformed_if_match_is_400(srv: ApiServer, http: Any) -> None:
    _name, client = new_tenant(srv, http)
    vm = created(client)
    before = snapshot(srv)
    for bad in ("3", "W/3", '"abc"', '"1", "2"', '"' + "9" * 30 + '"'):
        p = problem_of(client.post(f"/v1/vms/{vm['id']}/stop", headers={"If-Match": bad}), 400, "invalid")
        assert p["reasons"] == [{"field": "If-Match", "value": bad}]
        problem_of(client.delete(f"/v1/vms/{vm['id']}", headers={"If-Match": bad}), 400, "invalid")
    assert snapshot(srv) == before


# -- Idempotency-Key ------------------------------------------------------------------------------------------------


def _post(client: httpx.Client, body: dict[str, Any], key: str, path: str = "/v1/vms") -> httpx.Response:
    return client.post(path, content=json.dumps(body).encode(),
                       headers={"Idempotency-Key": key, "Content-Type": "application/json"})


def test_idempotency_key_replays_the_stored_response(srv: ApiServer, http: Any) -> None:
    name, client = new_tenant(srv, http)
    first = _post(client, VM_BODY, "k-1")
    assert first.status_code == 202 and "idempotent-replayed" not in first.headers
    done = wait_operation(client, first.headers["location"])
    assert done["state"] == "succeeded"
    again = _post(client, {**VM_BODY}, "k-1")
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"] and again.json() == first.json()
    assert [o["id"] for o in operations(srv) if o["tenant"] == name] == [first.json()["id"]]
    assert client.get("/v1/vms").json()["total"] == 1
    # the same body with its keys in another order is the same request
    reordered = dict(reversed(list(VM_BODY.items())))
    assert _post(client, reordered, "k-1").headers["location"] == first.headers["location"]
    # with ?wait the stored 201 is replayed with its Location and ETag
    w1 = client.post("/v1/vms", params={"wait": "30s"}, json={**VM_BODY, "name": "j2"},
                     headers={"Idempotency-Key": "k-2"})
    w2 = client.post("/v1/vms", params={"wait": "30s"}, json={**VM_BODY, "name": "j2"},
                     headers={"Idempotency-Key": "k-2"})
    assert (w1.status_code, w2.status_code) == (201, 201) and w2.json() == w1.json()
    for h in ("location", "etag", "operation-location"):
        assert w2.headers[h] == w1.headers[h], h
    # a stored refusal is replayed too, not run again
    admin = http("admin")
    assert admin.put(f"/v1/tenants/{name}/quota", json={"limits": {"vms": 2}}).status_code == 200
    r1 = client.post("/v1/vms", params={"wait": "30s"}, json={**VM_BODY, "name": "j3"},
                     headers={"Idempotency-Key": "k-3"})
    problem_of(r1, 409, "quota_exceeded")
    assert admin.put(f"/v1/tenants/{name}/quota", json={"limits": {"vms": None}}).status_code == 200
    r2 = client.post("/v1/vms", params={"wait": "30s"}, json={**VM_BODY, "name": "j3"},
                     headers={"Idempotency-Key": "k-3"})
    assert r2.status_code == 409 and r2.json() == r1.json() and r2.headers["idempotent-replayed"] == "true"
    assert r2.headers["content-type"] == "application/problem+json"
    # on another POST endpoint, too
    t1 = _post(admin, {"name": f"{name}-x"}, "tk", "/v1/tenants")
    t2 = _post(admin, {"name": f"{name}-x"}, "tk", "/v1/tenants")
    assert (t1.status_code, t2.status_code) == (201, 201) and t2.json() == t1.json()
    assert t2.headers["location"] == t1.headers["location"] == f"/v1/tenants/{name}-x"


def test_idempotency_key_covers_the_query_but_not_the_wait(srv: ApiServer, http: Any) -> None:
    _name, client = new_tenant(srv, http)
    admin = http("admin")
    yaml = {"content": DEMO.read_bytes(), "headers": {"Content-Type": "application/yaml", "Idempotency-Key": "inv"}}
    dry = admin.post("/v1/inventory", params={"dry_run": "true"}, **yaml)  # type: ignore[arg-type]
    assert dry.status_code == 200, dry.text
    before = snapshot(srv)
    p = problem_of(admin.post("/v1/inventory", params={"dry_run": "false"}, **yaml),  # type: ignore[arg-type]
                   422, "idempotency_key_reused")
    assert p["reasons"] == [{"field": "Idempotency-Key", "value": "inv"}]
    again = admin.post("/v1/inventory", params={"dry_run": "true"}, **yaml)  # type: ignore[arg-type]
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert snapshot(srv) == before
    waited = client.post("/v1/vms", params={"wait": "30s"}, json=VM_BODY, headers={"Idempotency-Key": "w"})
    assert waited.status_code == 201
    plain = client.post("/v1/vms", json=VM_BODY, headers={"Idempotency-Key": "w"})
    assert plain.status_code == 201 and plain.headers["idempotent-replayed"] == "true"
    assert plain.json() == waited.json() and client.get("/v1/vms").json()["total"] == 1


def test_idempotency_key_reused_with_another_body_is_422(srv: ApiServer, http: Any) -> None:
    _name, client = new_tenant(srv, http)
    first = _post(client, VM_BODY, "k-a")
    assert first.status_code == 202
    wait_operation(client, first.headers["location"])
    before = snapshot(srv)
    p = problem_of(_post(client, {**VM_BODY, "vcpus": 4}, "k-a"), 422, "idempotency_key_reused")
    assert p["reasons"] == [{"field": "Idempotency-Key", "value": "k-a"}]
    problem_of(_post(client, VM_BODY, "k-a", "/v1/placements"), 422, "idempotency_key_reused")
    assert snapshot(srv) == before


def test_idempotency_key_in_flight_is_409(srv: ApiServer, http: Any) -> None:
    from vgpu_ctl.service import idempotency as idem
    name, client = new_tenant(srv, http)
    raw = json.dumps({**VM_BODY, "name": "inflight"}).encode()
    with srv.ctl() as c, c.tx() as conn:  # the first request with this key is being answered right now
        assert idem.begin(conn, f"tenant:{name}", "k-busy", idem.fingerprint("POST", "/v1/vms", raw)).state == "new"
    before = snapshot(srv)
    r = client.post("/v1/vms", content=raw, headers={"Idempotency-Key": "k-busy", "Content-Type": "application/json"})
    p = problem_of(r, 409, "idempotency_key_in_flight")
    assert p["reasons"] == [{"field": "Idempotency-Key", "value": "k-busy"}] and r.headers["retry-after"] == "1"
    assert snapshot(srv) == before
    # another body with that key is still a reuse, not a duplicate
    problem_of(_post(client, VM_BODY, "k-busy"), 422, "idempotency_key_reused")


def test_idempotency_key_left_in_flight_by_a_dead_server_is_taken_again(srv: ApiServer, http: Any) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from vgpu_ctl.server.idempotent import IN_FLIGHT_STALE
    from vgpu_ctl.service import idempotency as idem
    from vgpu_ctl.store.models import utcnow
    from vgpu_ctl.store.tables import IDEMPOTENT
    name, client = new_tenant(srv, http)
    raw = json.dumps(VM_BODY).encode()
    with srv.ctl() as c, c.tx() as conn:  # a request a server began answering, then died
        assert idem.begin(conn, f"tenant:{name}", "k-dead", idem.fingerprint("POST", "/v1/vms", raw)).state == "new"
        conn.execute(update(IDEMPOTENT).where(IDEMPOTENT.c.key == "k-dead")
                     .values(created_at=utcnow() - IN_FLIGHT_STALE + timedelta(seconds=30)))
    headers = {"Idempotency-Key": "k-dead", "Content-Type": "application/json"}
    problem_of(client.post("/v1/vms", content=raw, headers=headers), 409, "idempotency_key_in_flight")
    with srv.ctl() as c, c.tx() as conn:
        conn.execute(update(IDEMPOTENT).where(IDEMPOTENT.c.key == "k-dead")
                     .values(created_at=utcnow() - IN_FLIGHT_STALE - timedelta(seconds=1)))
    r = client.post("/v1/vms", content=raw, headers=headers)
    assert r.status_code == 202 and "idempotent-replayed" not in r.headers, r.text
    assert wait_operation(client, r.headers["location"])["state"] == "succeeded"
    again = client.post("/v1/vms", content=raw, headers=headers)
    assert again.headers["idempotent-replayed"] == "true" and again.headers["location"] == r.headers["location"]


def test_idempotency_keys_are_per_tenant(srv: ApiServer, http: Any) -> None:
    a, ca = new_tenant(srv, http)
    b, cb = new_tenant(srv, http)
    ra = _post(ca, VM_BODY, "shared-key")
    rb = _post(cb, VM_BODY, "shared-key")
    assert (ra.status_code, rb.status_code) == (202, 202)
    assert "idempotent-replayed" not in rb.headers and rb.headers["location"] != ra.headers["location"]
    assert wait_operation(cb, rb.headers["location"])["result"]["tenant"] == b
    rb2 = _post(cb, {**VM_BODY, "vcpus": 3}, "shared-key")  # b's key is b's: another body is a reuse for b
    problem_of(rb2, 422, "idempotency_key_reused")
    assert wait_operation(ca, ra.headers["location"])["result"]["tenant"] == a


def test_bad_idempotency_key_is_400(srv: ApiServer, http: Any) -> None:
    _name, client = new_tenant(srv, http)
    before = snapshot(srv)
    for key in ("", "x" * 256, "tab\there"):
        p = problem_of(_post(client, VM_BODY, key), 400, "invalid")
        assert p["reasons"][0]["field"] == "Idempotency-Key"
    assert snapshot(srv) == before


def test_idempotency_keys_expire_after_the_ttl(tmp_path: Path) -> None:
    ttl = 3.0
    with api_server(tmp_path, tenants=("acme",), idempotency_ttl_s=ttl) as server:
        client = server.client("acme")
        sent = time.monotonic()
        first = _post(client, VM_BODY, "k-ttl")
        assert first.status_code == 202
        problem_of(_post(client, {**VM_BODY, "name": "j2"}, "k-ttl"), 422, "idempotency_key_reused")
        wait_operation(client, first.headers["location"])
        from sqlalchemy import select

        from vgpu_ctl.store.tables import IDEMPOTENT
        with server.ctl() as c, c.engine.connect() as conn:
            row = conn.execute(select(IDEMPOTENT).where(IDEMPOTENT.c.key == "k-ttl")).one()
        assert (row.expires_at - row.created_at).total_seconds() == pytest.approx(ttl, abs=0.01)
        time.sleep(max(0.0, sent + ttl + 0.3 - time.monotonic()))
        later = _post(client, {**VM_BODY, "name": "j2"}, "k-ttl")
        assert later.status_code == 202 and "idempotent-replayed" not in later.headers
        assert later.headers["location"] != first.headers["location"]
        assert wait_operation(client, later.headers["location"])["result"]["name"] == "j2"


# -- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "params", "field", "value"), [
    ({**VM_BODY, "vcpus": 10**30}, {}, "vcpus", "100000000000... (31 digits)"),
    ({**VM_BODY, "memory_mib": 2**63}, {}, "memory_mib", 2**63),
    ({**VM_BODY, "vcpus": True}, {}, "vcpus", True),
    ({**VM_BODY, "vgpus": [{"profile": "1g.10gb", "count": False}]}, {}, "vgpus.0.count", False),
    ({**VM_BODY, "vgpus": [{"profile": "1g.10gb", "count": 10**40}]}, {}, "count", None),
    ({**VM_BODY, "bogus": 1}, {}, "bogus", 1),
    ({**VM_BODY, "vgpus": [{"profile": "1g.10gb", "size": 3}]}, {}, "vgpus.0.size", 3),
    ({**VM_BODY, "vcpus": "eight"}, {}, "vcpus", "eight"),
    ({**VM_BODY, "vcpus": 2.5}, {}, "vcpus", 2.5),
    ({**VM_BODY, "vgpus": "1g.10gb"}, {}, "vgpus", "1g.10gb"),
    ({**VM_BODY, "vgpus": [{"profile": "1g.10gb", "count": 0}]}, {}, "count", 0),
    ({**VM_BODY, "name": "a b"}, {}, "name", "a b"),
    ({**VM_BODY, "name": "x\n"}, {}, "name", "x\n"),
    ({**VM_BODY, "vgpus": [{"profile": "1g.10gbb"}]}, {}, "profile", "1g.10gbb"),
    ({**VM_BODY, "pool": "nope"}, {}, "pool", "nope"),
    ({k: v for k, v in VM_BODY.items() if k != "vcpus"}, {}, "vcpus", None),
    (VM_BODY, {"wait": "abc"}, "wait", "abc"),
    (VM_BODY, {"wait": "10h"}, "wait", "10h"),
    (VM_BODY, {"wait": "301s"}, "wait", "301s"),
])
def test_bad_vm_requests_are_400_naming_the_field(srv: ApiServer, http: Any, body: dict[str, Any],
                                                  params: dict[str, str], field: str, value: Any) -> None:
    client = http("acme")
    before = snapshot(srv)
    r = create_vm(client, body, **params)
    status, code = (404, "not_found") if field == "pool" else (400, "invalid")
    p = problem_of(r, status, code)
    assert p["reasons"][0]["field"] == field, p
    if value is not None:
        assert p["reasons"][0]["value"] == value, p
        assert repr(value) in p["detail"] or str(value) in p["detail"], p
    assert snapshot(srv) == before


def test_bad_input_elsewhere_is_400_and_changes_nothing(srv: ApiServer, http: Any) -> None:
    admin, client = http("admin"), http("acme")
    before = snapshot(srv)
    cases = [
        (client.get("/v1/vms", params={"limit": 0}), "limit", 0),
        (client.get("/v1/vms", params={"limit": "ten"}), "limit", "ten"),
        (client.get("/v1/vms", params={"offset": -1}), "offset", -1),
        (client.get("/v1/operations", params={"limit": 10**25}), "limit", "100000000000... (26 digits)"),
        (client.get("/v1/operations/x", params={"wait": "soon"}), "wait", "soon"),
        (admin.get("/v1/status", params={"limit": 10**9}), "limit", 10**9),
        (admin.get("/v1/status", params={"gpus": "maybe"}), "gpus", "maybe"),
        (admin.get("/v1/events", params={"since": "yesterday-ish"}), "since", "yesterday-ish"),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"vms": 10**30}}), "vms", "100000000000... (31 digits)"),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"vms": -1}}), "vms", -1),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"gpus": 1}}), "resource", "gpus"),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"vms": "many"}}), "limits.vms", "many"),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"vms": True}}), "limits.vms", True),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {}, "extra": 1}), "extra", 1),
        (admin.post("/v1/tenants", json={"name": "Bad Name!"}), "tenant", "Bad Name!"),
        (admin.post("/v1/tenants", json={"name": 7}), "name", 7),
        (admin.post("/v1/tokens", json={"name": "t", "role": "root"}), "role", "root"),
        (admin.put("/v1/hosts/kvm-l40s-01/state", json={"state": "asleep"}), "state", "asleep"),
        (admin.post("/v1/vms", content=b"{not json", headers={"Content-Type": "application/json"}), "body", None),
        (admin.post("/v1/inventory", content=b"hosts: [1, 2", headers={"Content-Type": "application/yaml"}),
         None, None),
    ]
    for r, field, value in cases:
        assert r.status_code == 400, (field, r.status_code, r.text)
        p = problem_of(r, 400, r.json()["code"])
        assert p["code"] in ("invalid", "inventory"), p
        if field is not None:
            assert p["reasons"][0]["field"] == field, (field, p)
        if value is not None:
            assert p["reasons"][0]["value"] == value, (field, p)
    assert snapshot(srv) == before


def _nul_requests(admin: httpx.Client, tenant: httpx.Client) -> list[tuple[httpx.Response, str]]:
    """Requests with a NUL character in the path, the query or the body, and the field each must name."""
    yaml = {"Content-Type": "application/yaml"}
    return [
        (tenant.get("/v1/vms/a%00b"), "path"),
        (admin.get("/v1/tenants/acme%00"), "path"),
        (admin.delete("/v1/tokens/x%00"), "path"),
        (admin.get("/v1/vms", params={"tenant": "acme\x00"}), "tenant"),
        (admin.get("/v1/status", params={"host": "h\x00"}), "host"),
        (tenant.get("/v1/operations", params={"state": "\x00"}), "state"),
        (tenant.post("/v1/vms", json={**VM_BODY, "vgpus": [{"profile": "1g\x00"}]}), "vgpus.0.profile"),
        (tenant.post("/v1/vms", json={**VM_BODY, "labels": {"rack": "r1\x00"}}), "labels.rack"),
        (admin.put("/v1/tenants/acme/quota", json={"limits": {"profile:\x00": 1}}), "limits"),
        (admin.post("/v1/inventory", params={"dry_run": "true"}, headers=yaml,
                    content=b'pools:\n  - {name: p0, description: "a\\0b"}\nhosts: []\n'), "pools[0].description"),
    ]


def test_nul_characters_are_400_naming_the_field(srv: ApiServer, http: Any) -> None:
    before = snapshot(srv)
    for r, field in _nul_requests(http("admin"), http("acme")):
        p = problem_of(r, 400, r.json().get("code", "?"))
        assert p["reasons"][0]["field"] == field, (field, p)
    assert snapshot(srv) == before


def test_a_bug_is_a_500_problem_and_a_body_passes_on_whole() -> None:
    """The outermost layer turns an exception into a problem (the server would drop the connection) and hands
    the body it read to check it on unchanged."""
    import asyncio

    from vgpu_ctl.server.app import Guard
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        if scope["path"] == "/healthz":  # a path that needs no token: the app here has no store
            raise RuntimeError("a bug")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=Guard(app)), base_url="http://t") as c:
            return (await c.post("/healthz", json={"a": "b"}), await c.post("/metrics", json={"x": [1, "y"]}))

    boom, fine = asyncio.run(run())
    p = problem_of(boom, 500, "internal")
    assert "RuntimeError" in p["detail"] and "a bug" not in p["detail"]
    assert fine.status_code == 204
    assert seen == [b'{"a":"b"}', b'{"x":[1,"y"]}']


@pytest.mark.postgres
def test_nul_characters_are_400_on_postgresql(tmp_path: Path) -> None:
    """PostgreSQL refuses NUL in text: each of these was a 500 there."""
    from conftest import pg_schema
    with pg_schema() as url, api_server(tmp_path, tenants=("acme",), store=url) as server:
        admin, tenant = server.client("admin"), server.client("acme")
        for r, field in _nul_requests(admin, tenant):
            p = problem_of(r, 400, r.json().get("code", "?"))
            assert p["reasons"][0]["field"] == field, (field, p)
        assert tenant.get("/v1/vms").json()["total"] == 0  # and the connection still answers


# -- tenants, quotas, tokens, hosts, inventory and the operator's views ---------------------------------------------


def test_tenants_quotas_and_tokens(srv: ApiServer, http: Any) -> None:
    admin = http("admin")
    r = admin.post("/v1/tenants", json={"name": "initech"})
    assert r.status_code == 201 and r.headers["location"] == "/v1/tenants/initech"
    body = r.json()
    assert body["name"] == "initech" and body["has_token"] is False and r.headers["etag"] == f'"{body["generation"]}"'
    problem_of(admin.post("/v1/tenants", json={"name": "initech"}), 409, "conflict")
    issued = admin.post("/v1/tenants/initech/token")
    assert issued.status_code == 200 and issued.json()["tenant"] == "initech"
    token = issued.json()["token"]
    assert token.startswith("vgt_")
    me = http(token=token)
    assert [t["name"] for t in me.get("/v1/tenants").json()] == ["initech"]
    r = admin.put("/v1/tenants/initech/quota", json={"limits": {"vgpus": 2, "profile:1g.10gb": 1}})
    assert r.status_code == 200 and r.json() == {"vgpus": 2, "profile:1g.10gb": 1}
    limits = {q["resource"]: q["limit"] for q in me.get("/v1/tenants/initech/quota").json()}
    assert limits["vgpus"] == 2 and limits["profile:1g.10gb"] == 1
    r = admin.put("/v1/tenants/initech/quota", json={"limits": {"vgpus": 1}, "pool": "inference"})
    assert r.status_code == 200
    problem_of(admin.put("/v1/tenants/initech/quota", json={"limits": {"vgpus": 1}, "pool": "nope"}), 404,
               "not_found")
    assert admin.delete("/v1/tenants/initech/token").status_code == 204
    problem_of(me.get("/v1/tenants"), 401, "unauthenticated")
    assert admin.delete("/v1/tenants/initech").status_code == 204
    problem_of(admin.delete("/v1/tenants/initech"), 404, "not_found")

    made = admin.post("/v1/tokens", json={"name": "dash2", "role": "reader"})
    assert made.status_code == 201 and made.json()["role"] == "reader" and made.json()["token"].startswith("vga_")
    assert http(token=made.json()["token"]).get("/v1/inventory").status_code == 200
    listed = {t["name"]: t for t in admin.get("/v1/tokens").json()}
    assert listed["dash2"]["role"] == "reader" and "token" not in listed["dash2"]
    problem_of(admin.post("/v1/tokens", json={"name": "dash2", "role": "reader"}), 409, "conflict")
    assert admin.delete("/v1/tokens/dash2").status_code == 204
    problem_of(http(token=made.json()["token"]).get("/v1/inventory"), 401, "unauthenticated")
    problem_of(admin.delete("/v1/tokens/dash2"), 404, "not_found")
    problem_of(http("acme").get("/v1/tokens"), 403, "permission_denied")


def test_hosts_inventory_status_events_doctor_reconcile(srv: ApiServer, http: Any) -> None:
    admin = http("admin")
    r = admin.put("/v1/hosts/kvm-l40s-01/state", json={"state": "draining"})
    assert r.status_code == 200 and (r.json()["from"], r.json()["to"]) == ("active", "draining"), r.text
    try:
        state = {h["name"]: h["state"] for h in admin.get("/v1/hosts").json()}
        assert state["kvm-l40s-01"] == "draining"
        ws = {**VM_BODY, "name": "ws", "vgpus": [{"profile": "L40S-12C"}]}
        p = problem_of(admin.post("/v1/placements", json={**ws, "tenant": "acme"}), 409, "no_capacity")
        assert [(r["pool"], r["counts"]) for r in p["reasons"]] == [("workstations", {"host-draining": 2})], p
    finally:
        assert admin.put("/v1/hosts/kvm-l40s-01/state", json={"state": "active"}).status_code == 200
    problem_of(admin.put("/v1/hosts/nope/state", json={"state": "active"}), 404, "not_found")

    changes = admin.post("/v1/inventory", params={"dry_run": "true"}, content=DEMO.read_bytes(),
                         headers={"Content-Type": "application/yaml"})
    assert changes.status_code == 200, changes.text
    assert changes.json() == []  # the store holds what the file declares
    grown = DEMO.read_text().replace("\nhosts:\n", "\n  - {name: spare, policy: spread}\nhosts:\n", 1)
    before = snapshot(srv)
    dry = admin.post("/v1/inventory", params={"dry_run": "true"}, content=grown.encode(),
                     headers={"Content-Type": "application/yaml"})
    assert dry.status_code == 200, dry.text
    assert [c for c in dry.json() if c["action"] != "keep"] == [
        {"action": "add", "kind": "pool", "name": "spare",
         "fields": {"policy": "spread", "template": None, "description": "", "demand": None}}]
    assert snapshot(srv) == before

    status = admin.get("/v1/status", params={"pool": "inference"}).json()
    assert [p["name"] for p in status["pools"]] == ["inference"] and status["summary"] is not None
    problem_of(admin.get("/v1/status", params={"pool": "nope"}), 404, "not_found")
    events = admin.get("/v1/events", params={"tenant": "acme", "since": "1h", "limit": 5}).json()
    assert 0 < len(events) <= 5 and {e["tenant"] for e in events} == {"acme"}
    checks = admin.get("/v1/doctor").json()
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    problem_of(http("reader").get("/v1/doctor"), 403, "permission_denied")
    rec = admin.post("/v1/reconcile", json={"fix": False})
    assert rec.status_code == 200 and "findings" in rec.json(), rec.text
    assert admin.post("/v1/reconcile").status_code == 200
    problem_of(http("acme").post("/v1/reconcile"), 403, "permission_denied")


def test_zz_every_endpoint_was_exercised(request: pytest.FixtureRequest,
                                        templates: list[tuple[str, re.Pattern[str]]]) -> None:
    """Runs last: every operation of the OpenAPI document answered a test above with success (but the
    scheduling endpoints, whose own tests are in test_api_scheduling.py; schemathesis and the
    isolation tests cover them here)."""
    require_module_ran(request, RAN, "http")
    from vgpu_ctl.server import routes_scheduling
    theirs = {(m, r.path) for r in routes_scheduling.router.routes for m in getattr(r, "methods", ())}
    wanted = {tuple(name.split(" ", 1)) for name, _ in templates} - theirs
    assert wanted - CALLED == set()
